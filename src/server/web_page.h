// The built-in web page served at `/`: a streaming chat playground and a live engine view.
#pragma once
#include <string>

namespace serval {

const std::string& web_page_html();

}  // namespace serval

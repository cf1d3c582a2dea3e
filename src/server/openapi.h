// The OpenAPI description of the HTTP API (src/server/openapi.json, embedded at build time).
#pragma once
#include <string>

namespace serval {
const std::string& openapi_json();
}

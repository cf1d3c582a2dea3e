// Small PNG charts without a plotting library: an RGB canvas with lines, markers and a 5x7 bitmap
// font, written with libpng; and scatter panels (points joined in x order, each one labelled).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace serval::cli {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

class Canvas {
 public:
  Canvas(int width, int height);  // white
  int width() const { return w_; }
  int height() const { return h_; }
  void pixel(int x, int y, Rgb c);  // outside the canvas: ignored
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness = 1);
  void marker(int x, int y, int radius, Rgb c);  // a filled disc
  // Text with its top-left corner at (x, y): digits, letters (drawn upper-case) and . - _ % + ( ) / : =
  // (anything else as a space); each glyph 6 * scale pixels wide and 7 * scale high.
  void text(int x, int y, std::string_view s, Rgb c, int scale = 1);
  static int text_width(std::string_view s, int scale = 1) { return int(s.size()) * 6 * scale; }
  // Throws Error when the file cannot be written.
  void write_png(const std::string& path) const;

 private:
  int w_, h_;
  std::vector<uint8_t> rgb_;
};

struct ScatterPoint {
  double x = 0, y = 0;
  std::string label;
  int color = 0;  // index into a fixed palette: the same index, the same colour in every panel
};

struct ScatterPanel {
  std::string title, x_label;
  bool log_y = false;  // points with y <= 0 are left out of a log-scale panel
  std::vector<ScatterPoint> points;
};

// The panels stacked vertically, each 760 x 360 pixels, written to `path` as a PNG.
void write_scatter_png(const std::string& path, const std::vector<ScatterPanel>& panels);

}  // namespace serval::cli

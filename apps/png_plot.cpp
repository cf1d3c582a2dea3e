#include "apps/png_plot.h"

#include <fmt/core.h>
#include <png.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <tuple>

#include "base/error.h"

namespace serval::cli {
namespace {

// 5x7 glyphs, one byte per row, bit 4 the leftmost pixel.
constexpr std::string_view kChars = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.-_%+()/:=";
constexpr uint8_t kGlyphs[][7] = {
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}, {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 0 1
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}, {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},  // 2 3
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}, {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},  // 4 5
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}, {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // 6 7
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}, {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C},  // 8 9
    {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}, {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E},  // A B
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}, {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C},  // C D
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}, {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10},  // E F
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}, {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // G H
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}, {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C},  // I J
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}, {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F},  // K L
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}, {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},  // M N
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}, {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10},  // O P
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}, {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11},  // Q R
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}, {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // S T
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}, {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04},  // U V
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}, {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11},  // W X
    {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}, {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F},  // Y Z
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}, {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00},  // . -
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}, {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // _ %
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}, {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},  // + (
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}, {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // ) /
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}, {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00},  // : =
};
static_assert(std::size(kGlyphs) == kChars.size());

constexpr Rgb kBlack{0, 0, 0}, kGrey{200, 200, 200}, kPalette[] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44},
                                                                   {214, 39, 40},  {148, 103, 189}, {140, 86, 75}};
constexpr int kPanelW = 760, kPanelH = 360, kLeft = 80, kRight = 30, kTop = 40, kBottom = 50;

// Where a panel's data goes: the plot rectangle and the data range it shows.
struct Frame {
  int x0, y0, x1, y1;  // pixels: left, top, right, bottom
  double xlo, xhi, ylo, yhi;  // y in log10 units on a log panel
  bool log_y;
  double px(double x) const { return x0 + (x - xlo) / (xhi - xlo) * (x1 - x0); }
  double py(double y) const {
    const double v = log_y ? std::log10(y) : y;
    return y1 - (v - ylo) / (yhi - ylo) * (y1 - y0);
  }
};

// Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten, about five of them.
std::vector<double> nice_ticks(double lo, double hi) {
  const double raw = (hi - lo) / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag < 1.5 ? mag : raw / mag < 3.5 ? 2 * mag : raw / mag < 7.5 ? 5 * mag : 10 * mag;
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push_back(std::abs(t) < step * 1e-9 ? 0 : t);
  return ticks;
}

// [lo, hi] widened by 10% each side (by 1 when the values are all equal).
std::pair<double, double> padded(double lo, double hi) {
  const double pad = hi > lo ? 0.1 * (hi - lo) : 1;
  return {lo - pad, hi + pad};
}

Frame frame_for(const ScatterPanel& p, int top) {
  Frame f{kLeft, top + kTop, kPanelW - kRight, top + kPanelH - kBottom, 0, 1, 0, 1, p.log_y};
  double xlo = 1e300, xhi = -1e300, ylo = 1e300, yhi = -1e300;
  for (const auto& q : p.points) {
    if (p.log_y && q.y <= 0) continue;
    const double y = p.log_y ? std::log10(q.y) : q.y;
    xlo = std::min(xlo, q.x), xhi = std::max(xhi, q.x), ylo = std::min(ylo, y), yhi = std::max(yhi, y);
  }
  if (xlo > xhi) return f;  // nothing to show
  std::tie(f.xlo, f.xhi) = padded(xlo, xhi);
  if (p.log_y) {
    f.ylo = std::floor(ylo), f.yhi = std::max(std::ceil(yhi), f.ylo + 1);
  } else {
    std::tie(f.ylo, f.yhi) = padded(std::min(ylo, 0.0), std::max(yhi, 0.0));
  }
  return f;
}

void draw_axes(Canvas& c, const Frame& f, const ScatterPanel& p) {
  for (double x : nice_ticks(f.xlo, f.xhi)) {
    const double px = f.px(x);
    c.line(px, f.y0, px, f.y1, kGrey);
    const std::string s = fmt::format("{:g}", x);
    c.text(int(px) - Canvas::text_width(s) / 2, f.y1 + 6, s, kBlack);
  }
  std::vector<double> yt;
  if (p.log_y) {
    for (double k = f.ylo; k <= f.yhi; ++k) yt.push_back(k);
  } else {
    yt = nice_ticks(f.ylo, f.yhi);
  }
  for (double v : yt) {
    const double py = f.y1 - (v - f.ylo) / (f.yhi - f.ylo) * (f.y1 - f.y0);
    c.line(f.x0, py, f.x1, py, kGrey);
    const std::string s = p.log_y ? fmt::format("1E{}", int(v)) : fmt::format("{:g}", v);
    c.text(f.x0 - 6 - Canvas::text_width(s), int(py) - 3, s, kBlack);
  }
  c.line(f.x0, f.y1, f.x1, f.y1, kBlack), c.line(f.x0, f.y0, f.x0, f.y1, kBlack);
  c.text(f.x0, f.y0 - 26, p.title, kBlack, 2);
  c.text((f.x0 + f.x1 - Canvas::text_width(p.x_label)) / 2, f.y1 + 24, p.x_label, kBlack);
}

void draw_points(Canvas& c, const Frame& f, const ScatterPanel& p) {
  std::vector<const ScatterPoint*> pts;
  for (const auto& q : p.points)
    if (!p.log_y || q.y > 0) pts.push_back(&q);
  std::stable_sort(pts.begin(), pts.end(), [](auto* a, auto* b) { return a->x < b->x; });
  for (size_t i = 1; i < pts.size(); ++i) c.line(f.px(pts[i - 1]->x), f.py(pts[i - 1]->y), f.px(pts[i]->x), f.py(pts[i]->y), kGrey, 2);
  struct Box {
    int x, y, w;
  };
  std::vector<Box> placed;  // the labels drawn so far
  for (const auto* q : pts) {
    const int x = int(std::lround(f.px(q->x))), y = int(std::lround(f.py(q->y)));
    const Rgb col = kPalette[size_t(q->color) % std::size(kPalette)];
    c.marker(x, y, 4, col);
    const int w = Canvas::text_width(q->label);
    int lx = x + 8 + w > f.x1 ? x - 8 - w : x + 8, ly = y - 12;
    auto overlaps = [&](const Box& b) { return lx < b.x + b.w && b.x < lx + w && std::abs(b.y - ly) < 10; };
    while (std::any_of(placed.begin(), placed.end(), overlaps)) ly += 10;  // stack labels of nearby points
    placed.push_back({lx, ly, w});
    c.text(lx, ly, q->label, col);
  }
}

}  // namespace

Canvas::Canvas(int width, int height) : w_(width), h_(height), rgb_(size_t(width) * size_t(height) * 3, 255) {}

void Canvas::pixel(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
  uint8_t* p = rgb_.data() + (size_t(y) * size_t(w_) + size_t(x)) * 3;
  p[0] = c.r, p[1] = c.g, p[2] = c.b;
}

void Canvas::line(double x0, double y0, double x1, double y1, Rgb c, int thickness) {
  const int steps = int(std::max(std::abs(x1 - x0), std::abs(y1 - y0))) + 1;
  for (int s = 0; s <= steps; ++s) {
    const int x = int(std::lround(x0 + (x1 - x0) * s / steps)), y = int(std::lround(y0 + (y1 - y0) * s / steps));
    for (int t = 0; t < thickness; ++t) pixel(x, y + t, c), pixel(x + t, y, c);
  }
}

void Canvas::marker(int x, int y, int radius, Rgb c) {
  for (int dy = -radius; dy <= radius; ++dy)
    for (int dx = -radius; dx <= radius; ++dx)
      if (dx * dx + dy * dy <= radius * radius) pixel(x + dx, y + dy, c);
}

void Canvas::text(int x, int y, std::string_view s, Rgb c, int scale) {
  for (size_t i = 0; i < s.size(); ++i) {
    const char ch = char(std::toupper(static_cast<unsigned char>(s[i])));
    const size_t g = kChars.find(ch);
    if (g == std::string_view::npos) continue;
    for (int row = 0; row < 7 * scale; ++row)
      for (int col = 0; col < 5 * scale; ++col)
        if (kGlyphs[g][row / scale] & (0x10 >> (col / scale))) pixel(x + int(i) * 6 * scale + col, y + row, c);
  }
}

void Canvas::write_png(const std::string& path) const {
  FILE* f = std::fopen(path.c_str(), "wb");
  check(f != nullptr, "cannot write '{}'", path);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(f);
    fail("writing '{}' failed", path);
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, png_uint_32(w_), png_uint_32(h_), 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < h_; ++y) png_write_row(png, rgb_.data() + size_t(y) * size_t(w_) * 3);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  check(std::fclose(f) == 0, "writing '{}' failed", path);
}

void write_scatter_png(const std::string& path, const std::vector<ScatterPanel>& panels) {
  Canvas c(kPanelW, kPanelH * std::max<int>(1, int(panels.size())));
  for (size_t i = 0; i < panels.size(); ++i) {
    const Frame f = frame_for(panels[i], int(i) * kPanelH);
    draw_axes(c, f, panels[i]);
    draw_points(c, f, panels[i]);
  }
  c.write_png(path);
}

}  // namespace serval::cli

#pragma once
// A minimal 8-bit RGB image and a PNG writer (libpng), enough for the examples' pictures,
// with text in a built-in bitmap font (there is no font library to depend on).
#include <cstdint>
#include <string>
#include <vector>

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

struct RgbImage {
  RgbImage(int width, int height, Rgb fill = {});

  int width() const { return width_; }
  int height() const { return height_; }
  bool contains(int x, int y) const { return x >= 0 && y >= 0 && x < width_ && y < height_; }

  Rgb get(int x, int y) const;
  void set(int x, int y, Rgb color);  // ignores pixels outside the image
  // Mixes `color` over the pixel with opacity alpha in [0, 1] (for translucent overlays).
  void blend(int x, int y, Rgb color, double alpha);
  // Fills the half-open rectangle [x0, x1) x [y0, y1), clipped to the image.
  void fill_rect(int x0, int y0, int x1, int y1, Rgb color, double alpha = 1.0);

  // Row-major, 3 bytes per pixel.
  const uint8_t* row(int y) const { return pixels_.data() + 3 * static_cast<size_t>(width_) * y; }

 private:
  int width_;
  int height_;
  std::vector<uint8_t> pixels_;
};

// Writes `image` as an 8-bit RGB PNG; throws std::runtime_error naming the path on failure.
void write_png(const std::string& path, const RgbImage& image);

// ---- Text (bitmap_font.cpp) ----
// 5x7 glyphs (letters, digits, space and .,:-+=|/()[]<>%_'?) on a 6-pixel advance, with 2
// rows below the baseline for descenders. Each font pixel is drawn as a scale x scale square.
int text_width(const std::string& text, int scale);
int text_height(int scale);
// Draws `text` with its top-left corner at (x, y); a character without a glyph shows as '?'.
void draw_text(RgbImage& image, int x, int y, const std::string& text, Rgb color, int scale);

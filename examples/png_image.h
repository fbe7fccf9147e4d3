#pragma once
// A minimal 8-bit RGB image and a PNG writer (libpng), plus a small figure API for the
// examples' pictures: titled panels of 2-D fields, a colour bar and a legend, with text in a
// built-in bitmap font (there is no font library to depend on).
#include <cstdint>
#include <functional>
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

// ---- Figures (figure.cpp) ----
// How values map to colours; the panels and the colour bar use the same one.
struct ColorScale {
  std::function<Rgb(double)> color;  // called with values in [min, max]
  double min = 0, max = 1;
  std::string label;  // what the values are, printed above the bar
};

// How an overlay is drawn; a legend swatch draws its mark the same way.
enum class Mark {
  kLine,           // a solid line (block boundaries)
  kDashedOutline,  // the two long edges of a band, dashed: the data inside stays visible
};

struct LegendEntry {
  Mark mark;
  Rgb color;
  std::string label;
};

// One 2-D field, row-major, and the title drawn above it.
struct Panel {
  std::string title;
  std::vector<double> values;
};

struct FigureSpec {
  std::string heading;  // one line above everything; may be empty
  int rows = 0, cols = 0;
  int cell = 1;  // pixels per value along each axis
  std::vector<Panel> panels;
  ColorScale scale;
  std::vector<LegendEntry> legend;  // laid out below the panels, wrapped to the figure's width
};

// Where a panel landed: value (row, col) covers [x(col), x(col + 1)) x [y(row), y(row + 1)).
struct PanelArea {
  int x0, y0, rows, cols, cell;
  int x(int col) const { return x0 + col * cell; }
  int y(int row) const { return y0 + row * cell; }
};

struct Figure {
  RgbImage image;
  std::vector<PanelArea> panels;  // for drawing overlays after the layout
};

// Panels side by side with their titles, the colour bar (min, middle and max printed) to
// their right, the legend below. Throws std::invalid_argument if a panel is not rows x cols.
Figure draw_figure(const FigureSpec& spec);

// Where a field is cut into blocks: a solid line (Mark::kLine) at each cut and, as a dashed
// band (Mark::kDashedOutline) `halo` values deep on either side of it, what a window op
// reads across the cut. Green dashes stay visible on blue, white and red alike.
struct CutOverlay {
  std::vector<int> row_cuts, col_cuts;  // first row / column of every block but the first
  int halo = 0;
  Rgb line{20, 20, 20};
  Rgb band{0, 170, 80};
};
// Bands first, lines over them, so that crossing bands never hide a boundary.
void draw_cuts(RgbImage& image, const PanelArea& area, const CutOverlay& cuts);

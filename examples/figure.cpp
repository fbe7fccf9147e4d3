// Lays out the examples' figures: titled panels of 2-D fields, a colour bar and a legend
// (see FigureSpec in png_image.h), and draws block cuts and halo bands over the panels.
#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "png_image.h"

namespace {

constexpr int kTextScale = 2;               // 10x14-pixel capitals: legible at the figures' size
constexpr int kCapHeight = 7 * kTextScale;  // glyph height above the baseline
constexpr int kMargin = 12, kPanelGap = 12;
constexpr int kHeadingGap = 10, kTitleGap = 6;  // below the heading, below a panel's title
constexpr int kBarGap = 16, kBarWidth = 16, kTickLength = 4, kTickGap = 6;
constexpr int kLegendGap = 14, kSwatchWidth = 32, kSwatchGap = 8, kEntryGap = 28, kLineGap = 8;
constexpr int kLineWidth = 2;           // block boundaries and band edges
constexpr int kDash = 6, kDashGap = 4;  // dashed band edges
const Rgb kBackground{48, 48, 48};
const Rgb kTextColor{235, 235, 235};

// Solid lines centred on the pixel boundary at y (x).
void solid_hline(RgbImage& image, int x0, int x1, int y, Rgb color) {
  image.fill_rect(x0, y - kLineWidth / 2, x1, y - kLineWidth / 2 + kLineWidth, color);
}
void solid_vline(RgbImage& image, int x, int y0, int y1, Rgb color) {
  image.fill_rect(x - kLineWidth / 2, y0, x - kLineWidth / 2 + kLineWidth, y1, color);
}

// The two long edges of a band, dashed and inside it: the band's extent reads off the outer
// side of the dashes, and the data between them stays as it is. Dashes count from the band's
// start so that parallel bands on a panel line up.
void outline_rows(RgbImage& image, int x0, int x1, int top, int bottom, Rgb color) {
  for (int x = x0; x < x1; ++x)
    if ((x - x0) % (kDash + kDashGap) < kDash) {
      image.fill_rect(x, top, x + 1, top + kLineWidth, color);
      image.fill_rect(x, bottom - kLineWidth, x + 1, bottom, color);
    }
}
void outline_cols(RgbImage& image, int y0, int y1, int left, int right, Rgb color) {
  for (int y = y0; y < y1; ++y)
    if ((y - y0) % (kDash + kDashGap) < kDash) {
      image.fill_rect(left, y, left + kLineWidth, y + 1, color);
      image.fill_rect(right - kLineWidth, y, right, y + 1, color);
    }
}

// "%.3g", with a negative zero printed as 0.
std::string format_value(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3g", v == 0 ? 0.0 : v);
  return buffer;
}

// Max at the top, min at the bottom, the middle value halfway.
std::vector<double> tick_values(const ColorScale& scale) {
  return {scale.max, (scale.min + scale.max) / 2, scale.min};
}

int color_bar_width(const ColorScale& scale) {
  int label_width = 0;
  for (double v : tick_values(scale))
    label_width = std::max(label_width, text_width(format_value(v), kTextScale));
  return std::max(text_width(scale.label, kTextScale),
                  kBarWidth + kTickLength + kTickGap + label_width);
}

// The bar spans [top, top + height) next to the panels, its caption at caption_y.
void draw_color_bar(RgbImage& image, const ColorScale& scale, int x, int caption_y, int top,
                    int height) {
  draw_text(image, x, caption_y, scale.label, kTextColor, kTextScale);
  for (int y = 0; y < height; ++y) {
    const double f = (y + 0.5) / height;  // 0 at the top
    image.fill_rect(x, top + y, x + kBarWidth, top + y + 1,
                    scale.color(scale.max + f * (scale.min - scale.max)));
  }
  const std::vector<double> ticks = tick_values(scale);
  for (size_t i = 0; i < ticks.size(); ++i) {
    const int tick_y =
        top + static_cast<int>(i) * (height - 1) / (static_cast<int>(ticks.size()) - 1);
    image.fill_rect(x + kBarWidth, tick_y, x + kBarWidth + kTickLength, tick_y + 1, kTextColor);
    // Centred on the tick, but within the bar's height so that the end labels stay clear of
    // the caption above and the legend below.
    const int label_y = std::clamp(tick_y - kCapHeight / 2, top, top + height - kCapHeight);
    draw_text(image, x + kBarWidth + kTickLength + kTickGap, label_y, format_value(ticks[i]),
              kTextColor, kTextScale);
  }
}

int legend_entry_width(const LegendEntry& entry) {
  return kSwatchWidth + kSwatchGap + text_width(entry.label, kTextScale);
}

// Splits the legend into lines no wider than `width` (an entry wider than that gets a line
// of its own); returns each line's entries.
std::vector<std::vector<LegendEntry>> legend_lines(const std::vector<LegendEntry>& legend,
                                                   int width) {
  std::vector<std::vector<LegendEntry>> lines;
  int used = 0;
  for (const LegendEntry& e : legend) {
    const int w = legend_entry_width(e);
    if (lines.empty() || used + kEntryGap + w > width) {
      lines.emplace_back();
      used = w;
    } else {
      used += kEntryGap + w;
    }
    lines.back().push_back(e);
  }
  return lines;
}

// Each swatch shows its mark over `ground` (the scale's middle colour), as it looks on the
// panels; it is as tall as the capitals beside it.
void draw_legend(RgbImage& image, const std::vector<std::vector<LegendEntry>>& lines, int top,
                 Rgb ground) {
  for (size_t line = 0; line < lines.size(); ++line) {
    const int y = top + static_cast<int>(line) * (text_height(kTextScale) + kLineGap);
    int x = kMargin;
    for (const LegendEntry& e : lines[line]) {
      image.fill_rect(x, y, x + kSwatchWidth, y + kCapHeight, ground);
      if (e.mark == Mark::kLine)
        solid_hline(image, x, x + kSwatchWidth, y + kCapHeight / 2, e.color);
      else
        outline_rows(image, x, x + kSwatchWidth, y + 2, y + kCapHeight - 2, e.color);
      draw_text(image, x + kSwatchWidth + kSwatchGap, y, e.label, kTextColor, kTextScale);
      x += legend_entry_width(e) + kEntryGap;
    }
  }
}

}  // namespace

Figure draw_figure(const FigureSpec& spec) {
  const int n = static_cast<int>(spec.panels.size());
  if (n == 0 || spec.rows <= 0 || spec.cols <= 0 || spec.cell <= 0)
    throw std::invalid_argument("draw_figure: needs at least one panel of positive size");
  for (const Panel& p : spec.panels)
    if (p.values.size() != static_cast<size_t>(spec.rows) * spec.cols)
      throw std::invalid_argument("draw_figure: panel \"" + p.title + "\" has " +
                                  std::to_string(p.values.size()) + " values, not " +
                                  std::to_string(spec.rows) + "x" + std::to_string(spec.cols));
  const int text_h = text_height(kTextScale);
  const int panel_w = spec.cols * spec.cell, panel_h = spec.rows * spec.cell;

  // Widths first (the legend wraps to them), then heights.
  const int bar_x = kMargin + n * panel_w + (n - 1) * kPanelGap + kBarGap;
  int width = bar_x + color_bar_width(spec.scale) + kMargin;
  width = std::max(width, 2 * kMargin + text_width(spec.heading, kTextScale));
  for (const LegendEntry& e : spec.legend)
    width = std::max(width, 2 * kMargin + legend_entry_width(e));
  const auto lines = legend_lines(spec.legend, width - 2 * kMargin);
  const int titles_top = kMargin + (spec.heading.empty() ? 0 : text_h + kHeadingGap);
  const int panels_top = titles_top + text_h + kTitleGap;
  const int legend_top = panels_top + panel_h + kLegendGap;
  const int n_lines = static_cast<int>(lines.size());
  const int bottom =
      n_lines == 0 ? panels_top + panel_h : legend_top + n_lines * (text_h + kLineGap) - kLineGap;

  Figure figure{RgbImage(width, bottom + kMargin, kBackground), {}};
  RgbImage& image = figure.image;
  draw_text(image, kMargin, kMargin, spec.heading, kTextColor, kTextScale);
  for (int p = 0; p < n; ++p) {
    const PanelArea area{kMargin + p * (panel_w + kPanelGap), panels_top, spec.rows, spec.cols,
                         spec.cell};
    const std::vector<double>& values = spec.panels[p].values;
    for (int r = 0; r < spec.rows; ++r)
      for (int c = 0; c < spec.cols; ++c)
        image.fill_rect(area.x(c), area.y(r), area.x(c + 1), area.y(r + 1),
                        spec.scale.color(values[static_cast<size_t>(r) * spec.cols + c]));
    const std::string& title = spec.panels[p].title;
    const int title_x = area.x0 + std::max(0, (panel_w - text_width(title, kTextScale)) / 2);
    draw_text(image, title_x, titles_top, title, kTextColor, kTextScale);
    figure.panels.push_back(area);
  }
  draw_color_bar(image, spec.scale, bar_x, titles_top, panels_top, panel_h);
  draw_legend(image, lines, legend_top, spec.scale.color((spec.scale.min + spec.scale.max) / 2));
  return figure;
}

void draw_cuts(RgbImage& image, const PanelArea& area, const CutOverlay& cuts) {
  const int right = area.x(area.cols), bottom = area.y(area.rows);
  if (cuts.halo > 0) {
    for (int c : cuts.row_cuts)
      outline_rows(image, area.x0, right, area.y(std::max(0, c - cuts.halo)),
                   area.y(std::min(area.rows, c + cuts.halo)), cuts.band);
    for (int c : cuts.col_cuts)
      outline_cols(image, area.y0, bottom, area.x(std::max(0, c - cuts.halo)),
                   area.x(std::min(area.cols, c + cuts.halo)), cuts.band);
  }
  for (int c : cuts.row_cuts) solid_hline(image, area.x0, right, area.y(c), cuts.line);
  for (int c : cuts.col_cuts) solid_vline(image, area.x(c), area.y0, bottom, cuts.line);
}

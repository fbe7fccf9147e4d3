#include "png_image.h"

#include <algorithm>
#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <png.h>

RgbImage::RgbImage(int width, int height, Rgb fill) : width_(width), height_(height) {
  if (width <= 0 || height <= 0)
    throw std::invalid_argument("RgbImage: size must be positive, got " + std::to_string(width) +
                                "x" + std::to_string(height));
  pixels_.resize(3 * static_cast<size_t>(width) * height);
  for (size_t i = 0; i < pixels_.size(); i += 3) {
    pixels_[i] = fill.r;
    pixels_[i + 1] = fill.g;
    pixels_[i + 2] = fill.b;
  }
}

Rgb RgbImage::get(int x, int y) const {
  const uint8_t* p = row(y) + 3 * x;
  return {p[0], p[1], p[2]};
}

void RgbImage::set(int x, int y, Rgb color) {
  if (!contains(x, y)) return;
  uint8_t* p = pixels_.data() + 3 * (static_cast<size_t>(width_) * y + x);
  p[0] = color.r;
  p[1] = color.g;
  p[2] = color.b;
}

void RgbImage::blend(int x, int y, Rgb color, double alpha) {
  if (!contains(x, y)) return;
  const Rgb old = get(x, y);
  auto mix = [alpha](uint8_t under, uint8_t over) {
    return static_cast<uint8_t>(std::clamp(under + alpha * (over - under) + 0.5, 0.0, 255.0));
  };
  set(x, y, {mix(old.r, color.r), mix(old.g, color.g), mix(old.b, color.b)});
}

void RgbImage::fill_rect(int x0, int y0, int x1, int y1, Rgb color, double alpha) {
  for (int y = std::max(y0, 0); y < std::min(y1, height_); ++y)
    for (int x = std::max(x0, 0); x < std::min(x1, width_); ++x) blend(x, y, color, alpha);
}

namespace {

// libpng reports errors through a callback that must not return; keep the message and jump
// back into write_png, which turns it into an exception outside libpng's frames.
struct PngErrorState {
  char message[256] = "unknown libpng error";
};

void on_png_error(png_structp png, png_const_charp message) {
  auto* state = static_cast<PngErrorState*>(png_get_error_ptr(png));
  std::snprintf(state->message, sizeof(state->message), "%s", message);
  png_longjmp(png, 1);
}

void on_png_warning(png_structp, png_const_charp) {}  // nothing we write should warn

}  // namespace

void write_png(const std::string& path, const RgbImage& image) {
  // Everything that outlives a longjmp is set up before setjmp (no C++ objects are created
  // between setjmp and the libpng calls that may jump).
  std::vector<png_bytep> rows(image.height());
  for (int y = 0; y < image.height(); ++y) rows[y] = const_cast<png_bytep>(image.row(y));
  PngErrorState error;

  FILE* file = std::fopen(path.c_str(), "wb");
  if (!file)
    throw std::runtime_error("write_png: cannot open " + path + ": " + std::strerror(errno));
  png_structp png =
      png_create_write_struct(PNG_LIBPNG_VER_STRING, &error, on_png_error, on_png_warning);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info) {
    png_destroy_write_struct(png ? &png : nullptr, nullptr);
    std::fclose(file);
    throw std::runtime_error("write_png: libpng could not allocate its state for " + path);
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(file);
    throw std::runtime_error("write_png: " + path + ": " + error.message);
  }
  png_init_io(png, file);
  png_set_IHDR(png, info, image.width(), image.height(), 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  // Buffered bytes are written at close; a full disk shows up only here.
  if (std::fclose(file) != 0)
    throw std::runtime_error("write_png: error closing " + path + ": " + std::strerror(errno));
}

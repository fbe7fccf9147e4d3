// Domain-parallel training of a small neighbourhood-attention transformer on 4 ranks. The model
// (na_model.h: embedding, two blocks of [LayerNorm, NeighborhoodAttention2d, LayerNorm, MLP],
// head) learns to denoise 2-D fields of flat shapes with sharp edges: an attention window
// can average a pixel with the neighbours of its own shape and leave the other side of an
// edge alone. Every field is cut into four uneven blocks over a 2x2 mesh (rows 16 + 24 over
// mesh dim "h", columns 20 + 16 over "w" for the default 40x36 field), and the parameters
// are replicated. Only the attention reads other blocks: each rank receives the K/V rows its
// queries' windows reach (3 rows for k=7, 4 for k=5 with dilation 2) and nothing else.
//
// The same model is trained on one device in the same process (rank 0, whole fields, same
// initial weights, same batches); the losses are printed side by side and the parameters
// compared after training. The result is written as a PNG (noisy input | prediction | clean
// target of a held-out field) with the block boundaries and the K/V halo bands drawn on it.
//
//   tessera-run -n 4 ./build/examples/na_transformer [--steps 40] [--out na_transformer.png]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "na_model.h"
#include "png_image.h"
#include "progress_bar.h"
#include "tessera/tessera.h"

using na_model::NAConfig;
using na_model::NATransformer;
using tessera::Placements;
using tessera::ShardTable;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Fields {
  at::Tensor noisy;  // [B, H, W, 1]
  at::Tensor clean;  // [B, H, W, 1]
};

// Flat shapes on a flat background: discs and axis-aligned rectangles of random place, size
// and level, later shapes painted over earlier ones; plus Gaussian noise. A local generator
// with a fixed seed gives every rank the same batch without communication.
Fields make_fields(int64_t batch, int64_t rows, int64_t cols, double noise, uint64_t seed,
                   at::ScalarType dtype) {
  constexpr int64_t kShapes = 7;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto draws = at::rand({batch, kShapes, 5}, gen, at::kDouble);
  const auto ys = at::arange(rows, at::kDouble).view({rows, 1});
  const auto xs = at::arange(cols, at::kDouble).view({1, cols});
  auto clean = at::zeros({batch, rows, cols}, at::kDouble);
  const auto d = draws.accessor<double, 3>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < kShapes; ++s) {
      const double cy = d[b][s][0] * rows, cx = d[b][s][1] * cols;
      const double size = 2 + d[b][s][2] * 0.2 * std::min(rows, cols);
      const double level = d[b][s][3] < 0.5 ? -1.0 : 1.0;
      at::Tensor inside;
      if (d[b][s][4] < 0.5) {
        inside = (ys - cy).square() + (xs - cx).square() <= size * size;
      } else {
        inside = ((ys - cy).abs() <= size) & ((xs - cx).abs() <= 0.7 * size);
      }
      clean[b].masked_fill_(inside, level);
    }
  }
  const auto noisy = clean + noise * at::randn({batch, rows, cols}, gen, at::kDouble);
  return {noisy.unsqueeze(-1).to(dtype).contiguous(), clean.unsqueeze(-1).to(dtype).contiguous()};
}

// Uneven blocks: `first` rows for the first, the rest for the second.
ShardTable split(int64_t size, int64_t first) { return {first, size - first}; }

// Blue - white - red for [-1.5, 1.5].
Rgb field_colour(double v) {
  const double t = std::clamp(v / 1.5, -1.0, 1.0);
  auto mix = [](double a, double b, double f) {
    return static_cast<uint8_t>(std::lround(a + f * (b - a)));
  };
  if (t < 0) return {mix(245, 40, -t), mix(245, 80, -t), mix(245, 160, -t)};
  return {mix(245, 170, t), mix(245, 30, t), mix(245, 40, t)};
}

// Where the blocks meet: the first row (column) of every block but the first.
std::vector<int> cut_positions(const ShardTable& table) {
  std::vector<int> cuts;
  int64_t offset = 0;
  for (size_t i = 0; i + 1 < table.size(); ++i)
    cuts.push_back(static_cast<int>(offset += table[i]));
  return cuts;
}

std::vector<double> field_values(const at::Tensor& field) {
  const auto values = field.to(at::kDouble).contiguous();
  return {values.data_ptr<double>(), values.data_ptr<double>() + values.numel()};
}

// Noisy input | prediction | clean target, side by side, enlarged `scale` times. Each panel
// shows the block boundaries (lines) and, dashed so that the field stays visible, the rows /
// columns within `halo` of a cut: the K/V rows the attention reads from a neighbouring block.
RgbImage draw_fields(const std::string& heading, const std::vector<at::Tensor>& fields,
                     const ShardTable& row_blocks, const ShardTable& col_blocks, int halo,
                     int scale) {
  FigureSpec spec;
  spec.heading = heading;
  spec.rows = static_cast<int>(fields.at(0).size(0));
  spec.cols = static_cast<int>(fields.at(0).size(1));
  spec.cell = scale;
  const char* titles[] = {"noisy input", "prediction", "clean target"};
  for (size_t i = 0; i < fields.size(); ++i)
    spec.panels.push_back({titles[i], field_values(fields[i])});
  spec.scale = {field_colour, -1.5, 1.5, "field value"};
  CutOverlay cuts;
  cuts.row_cuts = cut_positions(row_blocks);
  cuts.col_cuts = cut_positions(col_blocks);
  cuts.halo = halo;
  spec.legend = {
      {Mark::kLine, cuts.line, "rank boundary"},
      {Mark::kDashedOutline, cuts.band,
       "halo: K/V rows/cols read across the boundary (" + std::to_string(halo) + " deep)"}};
  Figure figure = draw_figure(spec);
  for (const PanelArea& area : figure.panels) draw_cuts(figure.image, area, cuts);
  return figure.image;
}

double train_step(NATransformer& model, torch::optim::AdamW& opt, const at::Tensor& x,
                  const at::Tensor& y) {
  opt.zero_grad();
  auto loss = torch::mse_loss(model->forward(x), y);
  loss.backward();
  opt.step();
  return loss.item<double>();
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{
      "Domain-parallel training of a neighbourhood-attention transformer (4 ranks, 2x2 mesh)"};
  std::string out_path = "na_transformer.png";
  int steps = 40;
  int64_t rows = 40, cols = 36, first_rows = 16, first_cols = 20, batch = 4;
  double lr = 1e-2, noise = 0.5;
  bool use_double = false;
  NAConfig config;
  app.add_option("--out", out_path, "PNG to write on rank 0")->capture_default_str();
  app.add_option("--steps", steps, "training steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "field height")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{12}, int64_t{1024}));
  app.add_option("--cols", cols, "field width")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{12}, int64_t{1024}));
  app.add_option("--first-rows", first_rows, "rows of the top blocks (mesh dim \"h\")")
      ->capture_default_str();
  app.add_option("--first-cols", first_cols, "columns of the left blocks (mesh dim \"w\")")
      ->capture_default_str();
  app.add_option("--batch", batch, "fields per step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--dim", config.dim, "model width")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--heads", config.heads, "attention heads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--noise", noise, "noise standard deviation (the shapes are at -1 and 1)")
      ->capture_default_str();
  app.add_flag("--module-forward", config.module_forward,
               "the modules' own forward (Linear): shows the gathers of a Linear on a block cut "
               "along H and W");
  app.add_flag("--global-block", config.global_block,
               "a global self-attention block over every pixel after the NA blocks: context "
               "parallel attention over the 4 blocks' pixels (docs/context_parallel.md)");
  app.add_flag("--double", use_double,
               "train in float64 (the check against one device then holds to ~1e-12)");
  CLI11_PARSE(app, argc, argv);
  if (config.dim % config.heads != 0) {
    std::fprintf(stderr, "--dim must be a multiple of --heads\n");
    return 2;
  }
  if (first_rows < 0 || first_rows > rows || first_cols < 0 || first_cols > cols) {
    std::fprintf(stderr, "--first-rows / --first-cols must lie within the field\n");
    return 2;
  }
  const auto dtype = use_double ? at::kDouble : at::kFloat;

  at::set_num_threads(1);  // several ranks share few cores
  const auto started = Clock::now();
  tessera::init_process_group();
  const int rank = tessera::get_rank();
  TORCH_CHECK(tessera::get_world_size() == 4,
              "na_transformer runs on 4 ranks: tessera-run -n 4 na_transformer");
  auto mesh = tessera::init_device_mesh("cpu", {2, 2}, {"h", "w"});

  const ShardTable row_blocks = split(rows, first_rows), col_blocks = split(cols, first_cols);
  const Placements spatial = {tessera::Shard(1),
                              tessera::Shard(2)};  // rows over "h", cols over "w"
  const auto blocks = tessera::ShardSizes::Given({{}, row_blocks, col_blocks, {}});
  auto distribute = [&](const at::Tensor& t) {
    return tessera::distribute_tensor(t, mesh, spatial, std::nullopt, blocks);
  };

  // Same seed, same weights: the distributed model and its one-device twin start identical.
  torch::manual_seed(0);
  NATransformer model(config);
  torch::manual_seed(0);
  NATransformer reference(config);
  model->to(dtype);
  reference->to(dtype);
  tessera::distribute_module(*model, mesh);  // every parameter replicated over the mesh
  const auto adamw = torch::optim::AdamWOptions(lr).weight_decay(0.01);
  torch::optim::AdamW optimizer(model->parameters(), adamw);
  torch::optim::AdamW reference_optimizer(reference->parameters(), adamw);

  int halo = 0;  // the widest K/V halo of a cut away from the field's edges: (k / 2) * d
  for (const auto& b : config.blocks)
    halo = std::max<int>(halo, static_cast<int>((b.kernel / 2) * b.dilation));
  if (rank == 0) {
    std::printf("NA transformer: dim %lld, %lld heads, blocks", static_cast<long long>(config.dim),
                static_cast<long long>(config.heads));
    for (const auto& b : config.blocks)
      std::printf(" [k=%lld%s]", static_cast<long long>(b.kernel),
                  b.dilation > 1 ? (", d=" + std::to_string(b.dilation)).c_str() : "");
    int64_t n_params = 0;
    for (const auto& p : reference->parameters()) n_params += p.numel();
    if (config.global_block) std::printf(" [global attention over every pixel]");
    std::printf(", rpb, %lld parameters (%s)\n", static_cast<long long>(n_params),
                use_double ? "float64" : "float32");
    std::printf(
        "%lld fields of %lldx%lld per step on a 2x2 mesh: rows %s over \"h\", cols %s over \"w\"\n",
        static_cast<long long>(batch), static_cast<long long>(rows), static_cast<long long>(cols),
        tessera::shape_str(row_blocks).c_str(), tessera::shape_str(col_blocks).c_str());
  }
  {
    const auto probe = distribute(at::zeros({1, rows, cols, 1}, dtype));
    const auto off = tessera::spec(probe).local_offsets();
    const auto ext = tessera::spec(probe).local_sizes();
    std::printf("block rows [%lld, %lld) x cols [%lld, %lld)\n", static_cast<long long>(off[1]),
                static_cast<long long>(off[1] + ext[1]), static_cast<long long>(off[2]),
                static_cast<long long>(off[2] + ext[2]));
    std::fflush(stdout);
  }

  std::string step_communication;
  double training_seconds = 0, reference_seconds = 0, loss = 0, reference_loss = 0,
         max_loss_diff = 0;
  const int print_every = std::max(1, steps / 10);
  if (rank == 0) std::printf("%22s %6s %12s %12s %9s\n", "", "step", "4 ranks", "1 device", "|Δ|");
  for (int step = 1; step <= steps; ++step) {
    const Fields f = make_fields(batch, rows, cols, noise, 1000 + step, dtype);
    const auto x = distribute(f.noisy), y = distribute(f.clean);
    const auto t0 = Clock::now();
    if (step == 2) {
      tessera::CommDebugMode comm;  // a steady-state step: what domain parallelism moves
      loss = train_step(model, optimizer, x, y);
      step_communication = comm.table();
    } else {
      loss = train_step(model, optimizer, x, y);
    }
    training_seconds += seconds_since(t0);
    if (rank != 0) continue;  // the other ranks go on to the next step's collectives
    const auto t1 = Clock::now();
    reference_loss = train_step(reference, reference_optimizer, f.noisy, f.clean);
    reference_seconds += seconds_since(t1);
    max_loss_diff = std::max(max_loss_diff, std::abs(loss - reference_loss));
    if (step == 1 || step % print_every == 0 || step == steps)
      std::printf("%s %6d %12.6f %12.6f %9.1e\n", progress_bar(step, steps).c_str(), step, loss,
                  reference_loss, std::abs(loss - reference_loss));
  }

  // A held-out batch: the noisy input's error against the model's.
  const Fields test = make_fields(batch, rows, cols, noise, /*seed=*/7, dtype);
  at::Tensor prediction;
  {
    torch::NoGradGuard no_grad;
    prediction = tessera::full_tensor(model->forward(distribute(test.noisy)));  // collective
  }
  std::vector<std::pair<std::string, at::Tensor>> trained;
  for (const auto& item : model->named_parameters())
    trained.emplace_back(item.key(), tessera::is_dtensor(item.value())
                                         ? tessera::full_tensor(item.value()).detach()
                                         : item.value().detach());
  if (rank != 0) return 0;

  std::printf("trained %d steps in %.1f s (%.0f ms/step on 4 ranks; one device %.0f ms/step)\n",
              steps, training_seconds, 1000 * training_seconds / steps,
              1000 * reference_seconds / steps);
  if (!step_communication.empty())
    std::printf("communication of one training step (rank 0):\n%s", step_communication.c_str());
  double max_param_diff = 0;
  std::string worst;
  const auto reference_params = reference->named_parameters();
  for (const auto& [name, value] : trained) {
    const double d = (value - reference_params[name]).abs().max().item<double>();
    if (d > max_param_diff) max_param_diff = d, worst = name;
  }
  const double input_mse = at::mse_loss(test.noisy, test.clean).item<double>();
  const double model_mse = at::mse_loss(prediction, test.clean).item<double>();
  std::printf("held-out fields: noisy input MSE %.4f, prediction MSE %.4f (%.1fx lower)\n",
              input_mse, model_mse, input_mse / model_mse);
  // Sums in another order (per block, then all-reduced) differ by rounding only: float32
  // parameters stay within ~1e-6 after tens of steps, float64 within ~1e-12.
  const double tolerance = use_double ? 1e-10 : 1e-5;
  const bool ok = max_param_diff <= tolerance && max_loss_diff <= tolerance;
  std::printf(
      "vs one device: max loss |Δ| %.1e, max parameter |Δ| after %d steps %.1e (%s) -> %s "
      "(tolerance %.0e)\n",
      max_loss_diff, steps, max_param_diff, worst.empty() ? "-" : worst.c_str(),
      ok ? "OK" : "MISMATCH", tolerance);

  const int scale = static_cast<int>(std::max<int64_t>(4, (240 + cols - 1) / cols));
  const std::string heading =
      "held-out field after " + std::to_string(steps) + " training steps on 4 ranks";
  const auto image = draw_fields(
      heading, {test.noisy[0].squeeze(-1), prediction[0].squeeze(-1), test.clean[0].squeeze(-1)},
      row_blocks, col_blocks, halo, scale);
  write_png(out_path, image);
  std::printf(
      "wrote %s (%dx%d: noisy input | prediction | clean target of a held-out field; lines: "
      "block boundaries, dashed: K/V rows read across a cut)\n",
      out_path.c_str(), image.width(), image.height());
  std::printf("%s in %.1f s\n", ok ? "OK" : "FAILED", seconds_since(started));
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  // One line naming the failure instead of an abort with a stack trace; tessera-run then stops
  // the other ranks.
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "na_transformer: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "na_transformer: %s\n", e.what());
  }
  return 1;
}

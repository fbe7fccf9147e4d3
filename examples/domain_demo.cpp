// Domain-parallel training on 4 ranks. A small convolutional encoder-decoder learns one
// stretch of 2-D heat diffusion. Every input and target field is cut into four uneven
// spatial blocks over a 2x2 mesh (rows over mesh dim "h", columns over mesh dim "w"), and
// the parameters are replicated. The torch::nn module runs on the blocks unchanged:
// convolutions and pooling work on each rank's block plus the thin halos that the
// neighbouring ranks send, group norm combines its statistics over all blocks, and
// upsampling and the skip concatenation stay local. The first training step is checked
// against the same step on one device. The result is written as a PNG (input | prediction |
// target) with the rank boundaries and the halo bands drawn on it.
//
// --dp 2 trains data parallel x domain parallel instead (ShardTensor's layout): a 2x2 mesh
// ("dp", "h"), the batch split unevenly over "dp" and the rows over "h". --dp 4 is plain data
// parallelism. Either way replicate() sums every weight gradient in one bucket per step.
//
//   tessera-run -n 4 ./build/examples/domain_demo [--dp 1|2|4] [--steps 40] [--size 64] [--out
//   domain_demo.png]
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

#include "heat_net.h"
#include "png_image.h"
#include "progress_bar.h"
#include "tessera/tessera.h"

using namespace tessera;
using heat::HeatNet;
namespace nn = torch::nn;

namespace {

constexpr int64_t kBatch = 5;  // odd: data parallel ranks get uneven batches
constexpr int kDiffusionSteps = 16;
constexpr double kDiffusivity = 0.2;  // explicit 5-point scheme is stable below 0.25
constexpr int64_t kConvHalo = 1;  // a 3x3 convolution with padding 1 reads 1 row/col beyond a block

struct HeatData {
  at::Tensor initial;  // [B, 1, N, N] temperatures at t = 0
  at::Tensor later;    // the same fields after kDiffusionSteps steps
};

// One explicit heat-equation step with cold (zero) walls: u += k * laplacian(u).
at::Tensor diffuse_once(const at::Tensor& u) {
  const int64_t n_rows = u.size(2), n_cols = u.size(3);
  const auto padded = at::constant_pad_nd(u, {1, 1, 1, 1}, 0.0);
  auto shifted = [&](int64_t dy, int64_t dx) {
    return padded.slice(2, 1 + dy, 1 + dy + n_rows).slice(3, 1 + dx, 1 + dx + n_cols);
  };
  const auto laplacian = shifted(-1, 0) + shifted(1, 0) + shifted(0, -1) + shifted(0, 1) - 4 * u;
  return u + kDiffusivity * laplacian;
}

// Initial fields are sums of Gaussian blobs, hot and cold, of random place, width and
// strength. A local generator with a fixed seed gives every rank the same data without
// communication.
HeatData make_heat_data(int64_t batch, int64_t size, uint64_t seed) {
  constexpr int64_t kBlobs = 6;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto draws = at::rand({batch, kBlobs, 4, 1, 1}, gen);  // [B, blob, parameter, 1, 1]
  const auto center_y = 0.15 + 0.7 * draws.select(2, 0);
  const auto center_x = 0.15 + 0.7 * draws.select(2, 1);
  const auto width = 0.03 + 0.06 * draws.select(2, 2);
  const auto strength = 2 * draws.select(2, 3) - 1;
  const auto coord = at::linspace(0, 1, size);
  const auto ys = coord.view({1, 1, size, 1});
  const auto xs = coord.view({1, 1, 1, size});
  const auto dist2 = (ys - center_y).square() + (xs - center_x).square();
  auto u = (strength * at::exp(-dist2 / (2 * width.square()))).sum(1, /*keepdim=*/true);
  // Unit spread keeps activations O(1), so Adam's default-sized steps fit. Diffusion is
  // linear, so scaling before or after it is the same.
  u = u / u.std();
  HeatData data{u.contiguous(), u};
  for (int k = 0; k < kDiffusionSteps; ++k) data.later = diffuse_once(data.later);
  data.later = data.later.contiguous();
  return data;
}

// Uneven blocks, all of even size so that pooling by 2 then upsampling by 2 gives back the
// skip connection's layout: 64 rows split 24 + 40 and 64 columns 36 + 28.
ShardTable uneven_even_split(int64_t size, int64_t first_sixteenths) {
  const int64_t first = std::max<int64_t>(2, 2 * (first_sixteenths * size / 32));
  return {first, size - first};
}

double max_abs_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// Diverging blue-white-red ramp: cold is blue, zero is white, hot is red. t in [-1, 1].
Rgb diverging_color(double t) {
  static const Rgb stops[] = {
      {33, 62, 145}, {105, 150, 205}, {246, 246, 246}, {226, 128, 98}, {160, 22, 38}};
  constexpr int kSegments = 4;
  const double pos = (std::clamp(t, -1.0, 1.0) + 1) / 2 * kSegments;
  const int i = std::min(static_cast<int>(pos), kSegments - 1);
  const double f = pos - i;
  auto mix = [f](uint8_t a, uint8_t b) {
    return static_cast<uint8_t>(std::lround(a + f * (b - a)));
  };
  return {mix(stops[i].r, stops[i + 1].r), mix(stops[i].g, stops[i + 1].g),
          mix(stops[i].b, stops[i + 1].b)};
}

// Where the blocks meet along one dim: the running sums of the shard table, last one left out.
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

// Input | prediction | target of one 2-D field each, on one colour scale (symmetric about
// zero, as far as the input reaches), enlarged `scale` times. Each panel shows the block
// boundaries as solid lines and, dashed, the rows and columns that the 3x3 convolutions read
// from a neighbour (kConvHalo deep on each side of a cut).
RgbImage draw_fields(const std::string& heading, const std::vector<at::Tensor>& fields,
                     const ShardTable& row_blocks, const ShardTable& col_blocks, int scale) {
  const double vmax = std::max(1e-6, fields.at(0).abs().max().item<double>());
  FigureSpec spec;
  spec.heading = heading;
  spec.rows = static_cast<int>(fields.at(0).size(0));
  spec.cols = static_cast<int>(fields.at(0).size(1));
  spec.cell = scale;
  const char* titles[] = {"input", "prediction", "target"};
  for (size_t i = 0; i < fields.size(); ++i)
    spec.panels.push_back({titles[i], field_values(fields[i])});
  spec.scale = {[vmax](double v) { return diverging_color(v / vmax); }, -vmax, vmax, "temperature"};
  CutOverlay cuts;
  cuts.row_cuts = cut_positions(row_blocks);
  cuts.col_cuts = cut_positions(col_blocks);
  cuts.halo = kConvHalo;
  if (!cuts.row_cuts.empty() || !cuts.col_cuts.empty())
    spec.legend = {{Mark::kLine, cuts.line, "rank boundary"},
                   {Mark::kDashedOutline, cuts.band,
                    "halo: rows/cols a 3x3 conv reads across the boundary (" +
                        std::to_string(kConvHalo) + " deep)"}};
  Figure figure = draw_figure(spec);
  for (const PanelArea& area : figure.panels) draw_cuts(figure.image, area, cuts);
  return figure.image;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{
      "Domain-parallel training of a small U-Net on 2-D heat diffusion (4 ranks, 2x2 mesh)"};
  std::string out_path = "domain_demo.png";
  int steps = 40;
  int64_t size = 64;
  int dp = 1;
  app.add_option("--out", out_path, "PNG to write on rank 0")->capture_default_str();
  app.add_option("--dp", dp,
                 "data-parallel ranks (1: 2x2 domain mesh; 2: dp x rows; 4: data parallel only)")
      ->capture_default_str()
      ->check(CLI::IsMember({1, 2, 4}));
  app.add_option("--steps", steps, "training steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--size", size, "field height and width (even, at least 16)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{16}, int64_t{4096}));
  CLI11_PARSE(app, argc, argv);
  if (size % 2 != 0) {
    std::fprintf(stderr, "--size must be even (blocks must stay even-sized), got %lld\n",
                 static_cast<long long>(size));
    return 2;
  }

  // Several ranks share few cores; more threads per rank would only contend.
  at::set_num_threads(1);
  const auto started = std::chrono::steady_clock::now();
  init_process_group();
  const int rank = get_rank();
  TORCH_CHECK(get_world_size() == 4, "domain_demo runs on 4 ranks: tessera-run -n 4 domain_demo");
  // dp 1: rows over "h", columns over "w"; dp 2: batch over "dp", rows over "h"; dp 4: batch.
  const DeviceMesh mesh = dp == 1   ? init_device_mesh("cpu", {2, 2}, {"h", "w"})
                          : dp == 2 ? init_device_mesh("cpu", {2, 2}, {"dp", "h"})
                                    : init_device_mesh("cpu", {4}, {"dp"});

  // The same data on every rank, then each rank keeps its own block (no communication).
  const HeatData data = make_heat_data(kBatch, size, /*seed=*/2024);
  const ShardTable row_blocks =
      dp == 4 ? ShardTable{} : uneven_even_split(size, 6);  // 24 + 40 for 64
  const ShardTable col_blocks =
      dp == 1 ? uneven_even_split(size, 9) : ShardTable{};  // 36 + 28 for 64
  const ShardTable batch_blocks = dp == 2   ? ShardTable{2, 3}
                                  : dp == 4 ? ShardTable{2, 1, 1, 1}
                                            : ShardTable{};
  const Placements spatial = dp == 1   ? Placements{Shard(2), Shard(3)}
                             : dp == 2 ? Placements{Shard(0), Shard(2)}
                                       : Placements{Shard(0)};
  const auto blocks = ShardSizes::Given({batch_blocks, {}, row_blocks, col_blocks});
  const auto input = distribute_tensor(data.initial, mesh, spatial, std::nullopt, blocks);
  const auto target = distribute_tensor(data.later, mesh, spatial, std::nullopt, blocks);
  {
    const auto offsets = spec(input).local_offsets();
    const auto extent = spec(input).local_sizes();
    std::printf("block rows [%lld, %lld) x cols [%lld, %lld), local shape %s\n",
                static_cast<long long>(offsets[2]), static_cast<long long>(offsets[2] + extent[2]),
                static_cast<long long>(offsets[3]), static_cast<long long>(offsets[3] + extent[3]),
                shape_str(extent).c_str());
  }

  // Same seed, same weights: the distributed model and its one-device twin start identical.
  torch::manual_seed(0);
  HeatNet model;
  torch::manual_seed(0);
  HeatNet reference;
  // Every parameter replicated over the mesh, its gradient summed over all ranks in buckets
  // (one all-reduce per step for this model) as backward produces it.
  const auto data_parallel = replicate(*model, mesh);
  const double lr = 3e-3;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(lr));
  torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(lr));

  if (rank == 0 && dp == 1)
    std::printf(
        "%lld fields of %lldx%lld on a 2x2 mesh: rows split %s over \"h\", cols %s over \"w\"\n",
        static_cast<long long>(kBatch), static_cast<long long>(size), static_cast<long long>(size),
        shape_str(row_blocks).c_str(), shape_str(col_blocks).c_str());
  if (rank == 0 && dp == 2)
    std::printf(
        "%lld fields of %lldx%lld on a 2x2 mesh: samples split %s over \"dp\", rows %s over "
        "\"h\"\n",
        static_cast<long long>(kBatch), static_cast<long long>(size), static_cast<long long>(size),
        shape_str(batch_blocks).c_str(), shape_str(row_blocks).c_str());
  if (rank == 0 && dp == 4)
    std::printf("%lld fields of %lldx%lld, samples split %s over 4 data-parallel ranks\n",
                static_cast<long long>(kBatch), static_cast<long long>(size),
                static_cast<long long>(size), shape_str(batch_blocks).c_str());

  auto train_step = [](HeatNet& net, torch::optim::Adam& opt, const at::Tensor& x,
                       const at::Tensor& y) {
    opt.zero_grad();
    auto loss = torch::mse_loss(net->forward(x), y);
    loss.backward();
    opt.step();
    return loss.item<double>();
  };

  bool check_ok = true;
  std::string step_communication;
  const int print_every = std::max(1, steps / 8);
  double training_seconds = 0;  // distributed steps only, not the one-device check
  for (int step = 1; step <= steps; ++step) {
    double loss = 0;
    const auto step_started = std::chrono::steady_clock::now();
    if (step == 2) {
      CommDebugMode comm;  // one steady-state step: what domain parallelism costs in messages
      loss = train_step(model, optimizer, input, target);
      step_communication = comm.table();
    } else {
      loss = train_step(model, optimizer, input, target);
    }
    training_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_started).count();

    if (step == 1) {
      // The same step on one device, on the whole fields.
      const double reference_loss =
          train_step(reference, reference_optimizer, data.initial, data.later);
      double max_param_diff = 0;
      const auto reference_params = reference->named_parameters();
      for (const auto& item : model->named_parameters()) {
        const auto whole = full_tensor(item.value()).detach();  // collective: all ranks, same order
        max_param_diff =
            std::max(max_param_diff, max_abs_difference(whole, reference_params[item.key()]));
      }
      const double loss_diff = std::abs(loss - reference_loss);
      const double tolerance = 1e-4;
      check_ok = loss_diff <= tolerance && max_param_diff <= tolerance;
      if (rank == 0)
        std::printf(
            "check vs one device after step 1: loss |Δ| = %.1e, max param |Δ| = %.1e -> %s\n",
            loss_diff, max_param_diff, check_ok ? "OK" : "MISMATCH (tolerance 1e-4)");
    }
    if (rank == 0 && (step == 1 || step % print_every == 0 || step == steps))
      std::printf("%s step %*d/%d  loss %.3e\n", progress_bar(step, steps).c_str(),
                  static_cast<int>(std::to_string(steps).size()), step, steps, loss);
  }
  if (rank == 0) {
    std::printf("trained %d steps in %.1f s (%.0f ms/step)\n", steps, training_seconds,
                1000 * training_seconds / steps);
    if (!step_communication.empty())
      std::printf("communication of one training step (rank 0):\n%s", step_communication.c_str());
  }

  // Gather sample 0 (collective on every rank), draw on rank 0 only.
  at::Tensor prediction;
  {
    torch::NoGradGuard no_grad;
    prediction = full_tensor(model->forward(input));
  }
  const auto whole_input = full_tensor(input);
  const auto whole_target = full_tensor(target);
  if (rank == 0) {
    const int scale = static_cast<int>((256 + size - 1) / size);  // panels at least 256 px wide
    const auto blocks_along = [&](int64_t dim) {
      const auto& table = spec(input).shard_table(dim);
      return table.empty() ? ShardTable{size} : table;
    };
    const std::string heading =
        "sample 0 after " + std::to_string(steps) + " training steps on 4 ranks";
    const auto image =
        draw_fields(heading, {whole_input[0][0], prediction[0][0], whole_target[0][0]},
                    blocks_along(2), blocks_along(3), scale);
    write_png(out_path, image);
    std::printf(
        "wrote %s (%dx%d: input | prediction | target of sample 0; lines: rank "
        "boundaries, dashed: halo rows/cols)\n",
        out_path.c_str(), image.width(), image.height());
    const double total_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("%s in %.1f s\n", check_ok ? "OK" : "FAILED", total_seconds);
  }
  return check_ok ? 0 : 1;
}

int main(int argc, char** argv) {
  // One line naming the failure instead of an abort with a stack trace; tessera-run then stops
  // the other ranks.
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "domain_demo: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "domain_demo: %s\n", e.what());
  }
  return 1;
}

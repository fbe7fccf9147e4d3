// Distributed checkpoints against the values they were saved from: saved on 4 ranks under
// fully_shard x tensor parallel (uneven everywhere) and loaded on 1 to 4 ranks in other
// layouts; random tensors in random layouts (uneven tables, nested dims) resharded; training
// resumed bit-identically; asynchronous and overwriting saves; a plain LibTorch export; and
// errors raised on every rank.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>

#include <torch/optim/schedulers/step_lr.h>
#include <torch/serialize.h>

#include "fully_shard_helpers.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using tessera::test::fresh_dir;
namespace ckpt = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

at::Tensor full_value(const at::Tensor& t) {
  return is_dtensor(t) ? full_tensor(t.detach()) : t.detach();
}

// The layouts the MLP (l0 16x15, l1 7x16, l2 17x7, head 2x17) is trained or loaded in.
enum class Layout { Plain, Fsdp, Tp, FsdpTp };

const char* name_of(Layout l) {
  switch (l) {
    case Layout::Plain: return "plain";
    case Layout::Fsdp: return "fully_shard";
    case Layout::Tp: return "tensor parallel";
    default: return "fully_shard x tensor parallel";
  }
}

// On `world` ranks: Fsdp and Tp use a 1-D mesh; FsdpTp a 2 x (world / 2) ("dp", "tp") mesh.
// The mesh is made (collectively) unless `mesh_io` already holds one, and returned there.
std::shared_ptr<MlpImpl> build(const std::shared_ptr<MlpImpl>& proto, Layout layout, int world,
                               DeviceMesh* mesh_io = nullptr) {
  auto model = clone_of(proto);
  if (layout == Layout::Plain) return model;
  DeviceMesh mesh = mesh_io && mesh_io->defined() ? *mesh_io
                    : layout == Layout::FsdpTp
                        ? init_device_mesh("cpu", {2, world / 2}, {"dp", "tp"})
                        : init_device_mesh("cpu", {world}, {layout == Layout::Tp ? "tp" : "dp"});
  if (mesh_io) *mesh_io = mesh;
  if (layout == Layout::Tp || layout == Layout::FsdpTp)
    parallelize_module(*model, mesh["tp"],
                       {{"l0", ColwiseParallel().use_local_output(false)},
                        {"l1", RowwiseParallel().use_local_output(false)}});
  if (layout == Layout::Fsdp || layout == Layout::FsdpTp) {
    const DeviceMesh dp = mesh["dp"];
    fully_shard(model->l0, dp);
    fully_shard(model->l1, dp);
    fully_shard(model->l2, dp);
    fully_shard(*model, dp);
  }
  return model;
}

ckpt::StateDict training_state(MlpImpl& model, torch::optim::Optimizer& opt, int64_t step) {
  ckpt::StateDict s = ckpt::model_state(model);
  s.merge(ckpt::optimizer_state(opt, model));
  s.insert("step", step);
  return s;
}

}  // namespace

// The acceptance case: fully_shard x tensor parallel on 4 ranks (2 x 2), AdamW state after 3
// steps, loaded into 1 (plain), 2 (fully_shard), 3 (tensor parallel) and 4 (tensor parallel)
// ranks: every tensor's full value is the saved one, bit for bit, and the scalars come back.
TEST(Checkpoint, SavedOnFourRanksLoadsOnOneToFourInOtherLayouts) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 201, at::kDouble),
             y = test::randn({10, 2}, 202, at::kDouble);
  const std::string dir = fresh_dir("fsdp-tp") + "/step-3";
  std::map<std::string, at::Tensor> saved;
  tessera::testing::run_ranks(
      4,
      [&](int rank) {
        at::set_num_threads(1);
        DeviceMesh mesh;
        auto model = build(proto, Layout::FsdpTp, 4, &mesh);
        const ShardSizes rows = ShardSizes::Given(0, {7, 3});
        const Placements batch = {Shard(0), Replicate()};
        const auto dx = distribute_tensor(x, mesh, batch, std::nullopt, rows);
        const auto dy = distribute_tensor(y, mesh, batch, std::nullopt, rows);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        for (int s = 0; s < 3; ++s) {
          opt->zero_grad();
          at::mse_loss(model->forward(dx), dy).backward();
          opt->step();
        }
        auto state = training_state(*model, *opt, 3);
        state.insert("note", std::string("fsdp x tp"));
        ckpt::save(state, dir);
        for (const auto& [name, value] : state.items())
          if (const auto* t = std::get_if<at::Tensor>(&value)) {
            at::Tensor full = full_value(*t);  // collective
            if (rank == 0) saved[name] = full.clone();
          }
      },
      {std::chrono::seconds(120)});
  EXPECT_FALSE(saved.empty());
  for (const auto& e : ckpt::describe(dir))
    if (e.kind == "tensor") {
      EXPECT_TRUE(saved.count(e.name)) << e.name;
    }

  const std::vector<std::pair<int, Layout>> targets = {
      {1, Layout::Plain}, {2, Layout::Fsdp}, {3, Layout::Tp}, {4, Layout::Tp}};
  for (const auto& [world, layout] : targets) {
    const std::string what = std::to_string(world) + " ranks, " + name_of(layout);
    tessera::testing::run_ranks(
        world,
        [&](int) {
          at::set_num_threads(1);
          auto model = build(proto, layout, world);
          auto opt = make_optimizer(Opt::AdamW, model->parameters());
          auto state = training_state(*model, *opt, 0);
          state.insert("note", std::string());
          ckpt::load(state, dir);
          ckpt::restore_optimizer_scalars(state, *opt, *model);
          EXPECT_EQ(state.integer("step"), 3) << what;
          EXPECT_EQ(std::get<std::string>(state.at("note")), "fsdp x tp") << what;
          for (const auto& [name, value] : state.items())
            if (const auto* t = std::get_if<at::Tensor>(&value)) {
              EXPECT_TRUE(at::equal(full_value(*t), saved.at(name))) << what << ": " << name;
            }
        },
        {std::chrono::seconds(120)});
  }
}

// Random tensors, each saved from a random layout (1-D or 2-D mesh, Shard / Replicate /
// Partial, uneven and empty shard tables, two mesh dims cutting one tensor dim) and loaded
// into another random layout on another number of ranks.
TEST(Checkpoint, RandomLayoutsReshardExactly) {
  std::mt19937_64 rng(2026);
  auto pick = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  struct Layout2 {
    std::vector<int64_t> mesh;
    Placements placements;
    std::vector<ShardTable> tables;  // per tensor dim, empty = chunk layout
  };
  // A random layout of `shape` on a random mesh of `world` ranks.
  auto random_layout = [&](const std::vector<int64_t>& shape, int world, bool allow_partial) {
    Layout2 l;
    l.mesh = world == 4 && pick(2) ? std::vector<int64_t>{2, 2} : std::vector<int64_t>{world};
    l.tables.resize(shape.size());
    std::vector<int64_t> pieces(shape.size(), 1);
    for (size_t m = 0; m < l.mesh.size(); ++m) {
      const int64_t k = pick(allow_partial ? 4 : 3);
      if (k == 0 || shape.empty()) {
        l.placements.push_back(Replicate());
      } else if (k == 3) {
        l.placements.push_back(Partial());
      } else {
        const int64_t d = pick(static_cast<int64_t>(shape.size()));
        l.placements.push_back(Shard(d));
        pieces[d] *= l.mesh[m];
      }
    }
    // Uneven tables (zeros included) for about half the sharded dims.
    for (size_t d = 0; d < shape.size(); ++d) {
      if (pieces[d] == 1 || pick(2)) continue;
      ShardTable t(pieces[d], 0);
      for (int64_t i = 0; i < shape[d]; ++i) ++t[pick(pieces[d])];
      l.tables[d] = t;
    }
    return l;
  };
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t ndim = 1 + pick(3);
    std::vector<int64_t> shape;
    for (int64_t d = 0; d < ndim; ++d) shape.push_back(pick(7));  // 0 included
    const at::ScalarType dtype = pick(2) ? at::kFloat : at::kLong;
    const at::Tensor full =
        dtype == at::kLong ? at::randint(-50, 50, shape, at::kLong) : at::randn(shape, at::kFloat);
    const int src_world = 1 + static_cast<int>(pick(4)), dst_world = 1 + static_cast<int>(pick(4));
    const Layout2 src = random_layout(shape, src_world, true);
    const Layout2 dst = random_layout(shape, dst_world, false);
    const std::string dir = fresh_dir("random") + "/c";
    const std::string what = "trial " + std::to_string(trial) + " " + shape_str(shape) + " " +
                             to_string(src.placements) + " on " + shape_str(src.mesh) + " -> " +
                             to_string(dst.placements) + " on " + shape_str(dst.mesh);
    tessera::testing::run_ranks(
        src_world,
        [&](int) {
          auto mesh = init_device_mesh("cpu", src.mesh);
          // Partial placements hold full / n on each rank: the sum is the value.
          Placements as_replicate = src.placements;
          int64_t parts = 1;
          for (size_t m = 0; m < as_replicate.size(); ++m)
            if (as_replicate[m].is_partial()) as_replicate[m] = Replicate(), parts *= src.mesh[m];
          at::Tensor d = distribute_tensor(full, mesh, as_replicate, std::nullopt,
                                           ShardSizes::Given(src.tables));
          if (parts > 1) {
            at::Tensor local = to_local(d);
            if (dtype == at::kLong) {  // integers: the first rank of each sum keeps the value
              bool first = true;
              for (size_t m = 0; m < src.placements.size(); ++m)
                if (src.placements[m].is_partial() && mesh.coordinate()[m] != 0) first = false;
              local = first ? local : at::zeros_like(local);
            } else {
              local = local / static_cast<double>(parts);
            }
            d = from_local(local, mesh, src.placements, {ShardSizes::Given(src.tables)});
          }
          ckpt::StateDict s;
          s.insert("x", d);
          ckpt::save(s, dir);
        },
        {std::chrono::seconds(60)});
    tessera::testing::run_ranks(dst_world,
                                [&](int) {
                                  auto mesh = init_device_mesh("cpu", dst.mesh);
                                  at::Tensor target = distribute_tensor(
                                      at::zeros(shape, dtype), mesh, dst.placements, std::nullopt,
                                      ShardSizes::Given(dst.tables));
                                  ckpt::StateDict s;
                                  s.insert("x", target);
                                  ckpt::load(s, dir);
                                  const at::Tensor got = full_tensor(target);
                                  if (dtype == at::kLong) {
                                    EXPECT_TRUE(at::equal(got, full)) << what;
                                  } else
                                    EXPECT_TRUE(at::allclose(got, full, 1e-6, 1e-6)) << what;
                                },
                                {std::chrono::seconds(60)});
  }
}

// Saved after step 3 of 6 and resumed in a new model, optimizer and StepLR schedule (the
// learning rate halves every 2 steps): the remaining losses and the final parameters are
// bit-identical to training without the interruption.
TEST(Checkpoint, ResumedTrainingIsBitIdentical) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 211, at::kDouble),
             y = test::randn({10, 2}, 212, at::kDouble);
  const std::string dir = fresh_dir("resume") + "/step-3";
  tessera::testing::run_ranks(
      2,
      [&](int) {
        at::set_num_threads(1);
        DeviceMesh mesh;
        auto step_of = [&](MlpImpl& model, torch::optim::Optimizer& opt, torch::optim::StepLR& lr,
                           const at::Tensor& dx, const at::Tensor& dy) {
          opt.zero_grad();
          at::Tensor loss = at::mse_loss(model.forward(dx), dy);
          loss.backward();
          opt.step();
          lr.step();
          return full_value(loss).item<double>();
        };
        auto straight = build(proto, Layout::Fsdp, 2, &mesh);
        const auto dx = local_batch(x, mesh, {6, 4}), dy = local_batch(y, mesh, {6, 4});
        auto opt = make_optimizer(Opt::AdamW, straight->parameters());
        torch::optim::StepLR lr(*opt, 2, 0.5);
        std::vector<double> expected;
        for (int s = 0; s < 6; ++s) expected.push_back(step_of(*straight, *opt, lr, dx, dy));

        auto first = build(proto, Layout::Fsdp, 2, &mesh);
        auto opt1 = make_optimizer(Opt::AdamW, first->parameters());
        torch::optim::StepLR lr1(*opt1, 2, 0.5);
        for (int s = 0; s < 3; ++s) EXPECT_EQ(step_of(*first, *opt1, lr1, dx, dy), expected[s]);
        auto saved = training_state(*first, *opt1, 3);
        saved.merge(ckpt::scheduler_state(lr1));
        ckpt::save(saved, dir);

        auto resumed = build(proto, Layout::Fsdp, 2, &mesh);
        auto opt2 = make_optimizer(Opt::AdamW, resumed->parameters());
        torch::optim::StepLR lr2(*opt2, 2, 0.5);
        auto state = training_state(*resumed, *opt2, 0);
        state.merge(ckpt::scheduler_state(lr2));
        ckpt::load(state, dir);
        ckpt::restore_optimizer_scalars(state, *opt2, *resumed);
        ckpt::restore_scheduler(state, lr2);
        for (int s = static_cast<int>(state.integer("step")); s < 6; ++s)
          EXPECT_EQ(step_of(*resumed, *opt2, lr2, dx, dy), expected[s]) << "step " << s;
        EXPECT_EQ(opt2->param_groups()[0].options().get_lr(),
                  opt->param_groups()[0].options().get_lr());
        const auto want = straight->named_parameters();
        for (const auto& item : resumed->named_parameters())
          EXPECT_TRUE(at::equal(full_value(item.value()), full_value(want[item.key()])))
              << item.key();
      },
      {std::chrono::seconds(120)});
}

// async_save copies to host memory first: changing the tensors before wait() does not change
// the checkpoint. Overwriting replaces an existing checkpoint only once the new one is
// complete; without `overwrite` an existing path is an error.
TEST(Checkpoint, AsyncSaveAndOverwrite) {
  const std::string dir = fresh_dir("async") + "/c";
  const auto value = test::randn({9, 4}, 221, at::kFloat);
  tessera::testing::run_ranks(
      3,
      [&](int) {
        auto mesh = init_device_mesh("cpu", {3});
        at::Tensor d = distribute_tensor(value, mesh, {Shard(0)}, std::nullopt,
                                         ShardSizes::Given(0, {5, 0, 4}));
        ckpt::StateDict s;
        s.insert("w", d);
        s.insert("lr", 0.5);
        s.insert("flag", true);
        auto pending = ckpt::async_save(s, dir);
        to_local(d).fill_(-1);  // training goes on
        pending.wait();
        ckpt::StateDict back;
        at::Tensor target = distribute_tensor(at::zeros({9, 4}), mesh, {Replicate()}, std::nullopt);
        back.insert("w", target);
        back.insert("lr", 0.0);
        back.insert("flag", false);
        ckpt::load(back, dir);
        EXPECT_TRUE(at::equal(to_local(target), value));
        EXPECT_EQ(back.real("lr"), 0.5);
        EXPECT_TRUE(std::get<bool>(back.at("flag")));

        try {
          ckpt::save(s, dir);
          ADD_FAILURE() << "saving over an existing checkpoint without overwrite";
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("already exists"), std::string::npos) << e.what();
        }
        ckpt::SaveOptions o;
        o.overwrite = true;
        ckpt::save(s, dir, o);  // now the -1s
        ckpt::load(back, dir);
        EXPECT_TRUE(at::equal(to_local(target), at::full({9, 4}, -1.0f)));
      },
      {std::chrono::seconds(60)});
  // Nothing left beside it: no temporary or old directory.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(fs::path(dir).parent_path())) (void)e, ++entries;
  EXPECT_EQ(entries, 1);
}

// export_module writes LibTorch's own module file: torch::load fills an unchanged
// one-device module with the full values; import_module fills a differently distributed one.
TEST(Checkpoint, ExportLoadsWithPlainTorchLoadAndImports) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 231, at::kDouble),
             y = test::randn({10, 2}, 232, at::kDouble);
  const std::string file = fresh_dir("export") + "/model.pt";
  std::map<std::string, at::Tensor> trained;
  tessera::testing::run_ranks(4,
                              [&](int rank) {
                                at::set_num_threads(1);
                                DeviceMesh mesh;
                                auto model = build(proto, Layout::FsdpTp, 4, &mesh);
                                const Placements batch = {Shard(0), Replicate()};
                                const auto dx = distribute_tensor(x, mesh, batch, std::nullopt);
                                const auto dy = distribute_tensor(y, mesh, batch, std::nullopt);
                                train(*model, Opt::Sgd, dx, dy, 2);
                                ckpt::export_module(*model, file);
                                for (const auto& item : model->named_parameters()) {
                                  at::Tensor full = full_value(item.value());
                                  if (rank == 0) trained[item.key()] = full;
                                }
                              },
                              {std::chrono::seconds(60)});
  auto plain = clone_of(proto);
  torch::load(plain, file);
  for (const auto& item : plain->named_parameters())
    EXPECT_TRUE(at::equal(item.value(), trained.at(item.key()))) << item.key();
  tessera::testing::run_ranks(
      3,
      [&](int) {
        auto model = build(proto, Layout::Tp, 3);
        ckpt::import_module(*model, file);
        for (const auto& item : model->named_parameters())
          EXPECT_TRUE(at::equal(full_value(item.value()), trained.at(item.key()))) << item.key();
      },
      {std::chrono::seconds(60)});
}

// Every failure is a c10::Error on every rank naming the entry: a corrupt byte, a missing
// data file or metadata, another shape or dtype, an entry the checkpoint lacks, and ranks
// passing different states.
TEST(Checkpoint, ErrorsAreRaisedOnEveryRank) {
  const std::string root = fresh_dir("errors");
  const std::string dir = root + "/c";
  const auto value = test::randn({8, 3}, 241, at::kFloat);
  tessera::testing::run_ranks(2,
                              [&](int) {
                                auto mesh = init_device_mesh("cpu", {2});
                                ckpt::StateDict s;
                                s.insert("w",
                                         distribute_tensor(value, mesh, {Shard(0)}, std::nullopt));
                                ckpt::save(s, dir);
                              },
                              {std::chrono::seconds(60)});
  fs::copy(dir, root + "/corrupt", fs::copy_options::recursive);
  fs::copy(dir, root + "/missing", fs::copy_options::recursive);
  {
    std::fstream f(root + "/corrupt/data-00001.bin",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x7f');
  }
  fs::remove(root + "/missing/data-00001.bin");
  auto expect_everywhere = [&](const std::function<void(const DeviceMesh&)>& fn,
                               const std::string& needle) {
    std::atomic<int> raised{0};
    tessera::testing::run_ranks(
        2,
        [&](int) {
          auto mesh = init_device_mesh("cpu", {2});
          try {
            fn(mesh);
            ADD_FAILURE() << "expected an error containing \"" << needle << "\"";
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
            ++raised;
          }
        },
        {std::chrono::seconds(60)});
    EXPECT_EQ(raised.load(), 2) << needle;
  };
  auto load_into = [](const std::string& path, at::Tensor t) {
    ckpt::StateDict s;
    s.insert("w", t);
    ckpt::load(s, path);
  };
  // Rank 0 reads only data-00000.bin when loading shard for shard, so it learns of rank 1's
  // corrupt block from rank 1.
  expect_everywhere(
      [&](const DeviceMesh& m) {
        load_into(root + "/corrupt",
                  distribute_tensor(at::zeros({8, 3}), m, {Shard(0)}, std::nullopt));
      },
      "checksum mismatch");
  expect_everywhere(
      [&](const DeviceMesh& m) {
        load_into(root + "/missing",
                  distribute_tensor(at::zeros({8, 3}), m, {Replicate()}, std::nullopt));
      },
      "data-00001.bin");
  expect_everywhere(
      [&](const DeviceMesh&) {
        load_into(root + "/nothing", at::zeros({8, 3}));
      },
      "no checkpoint at");
  expect_everywhere(
      [&](const DeviceMesh&) {
        load_into(dir, at::zeros({8, 4}));
      },
      "saved float32 [8, 3], loading into float32 [8, 4]");
  expect_everywhere(
      [&](const DeviceMesh&) {
        load_into(dir, at::zeros({8, 3}, at::kDouble));
      },
      "loading into float64");
  expect_everywhere(
      [&](const DeviceMesh&) {
        ckpt::StateDict s;
        s.insert("v", at::zeros({1}));
        ckpt::load(s, dir);
      },
      "\"v\" is not in the checkpoint");
  expect_everywhere(
      [&](const DeviceMesh& m) {
        ckpt::StateDict s;
        s.insert(m.coordinate()[0] == 0 ? "a" : "b", at::zeros({1}));
        ckpt::save(s, root + "/disagree");
      },
      "ranks passed different states");
  EXPECT_FALSE(fs::exists(root + "/disagree"));
}

// Devices and transports: which device a mesh keeps its tensors on, how its collectives
// travel, and the collective layer's refusal of a tensor on another device (NOTE: [Devices on
// the wire]). The CUDA paths themselves run in tests/gpu/ on a machine with a GPU.
#include "helpers.h"

using namespace tessera;

namespace {

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST(Devices, CpuMeshIsHostAndGloo) {
  for (int n : {1, 2, 3}) {
    tessera::testing::run_ranks(n, [n](int rank) {
      auto mesh = init_device_mesh("cpu", {n});
      EXPECT_EQ(mesh.backend(), "gloo");
      EXPECT_EQ(mesh.device(), c10::Device(c10::DeviceType::CPU));
      EXPECT_EQ(comm::home_device(mesh.group(0)), c10::Device(c10::DeviceType::CPU));
      EXPECT_FALSE(comm::staged(mesh.group(0)));
      // Ranks as threads are all on this host: the local rank is the rank.
      EXPECT_EQ(get_local_rank(), rank);
      // The transport can be named, as in PyTorch's "cpu:gloo".
      auto named = init_device_mesh("cpu:gloo", {n});
      EXPECT_EQ(named.backend(), "gloo");
      EXPECT_EQ(named.str().find(":gloo"), std::string::npos) << named.str();
    });
  }
}

TEST(Devices, UnknownDeviceOrTransportIsAClearError) {
  tessera::testing::run_ranks(2, [](int) {
    auto msg = error_of([] { init_device_mesh("tpu", {2}); });
    EXPECT_NE(msg.find("unknown device_type \"tpu\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("cuda:gloo"), std::string::npos) << msg;
    msg = error_of([] { init_device_mesh("cpu:nccl", {2}); });
    EXPECT_NE(msg.find("names no transport"), std::string::npos) << msg;
  });
}

TEST(Devices, CudaMeshWithoutCudaSaysSo) {
  if (at::hasCUDA()) {
    GTEST_SKIP() << "this machine has CUDA: tests/gpu/ covers CUDA meshes";
  }
  tessera::testing::run_ranks(2, [](int) {
    for (const char* type : {"cuda", "cuda:gloo"}) {
      auto msg = error_of([&] { init_device_mesh(type, {2}); });
      EXPECT_NE(msg.find("needs a CUDA device"), std::string::npos) << type << ": " << msg;
      EXPECT_NE(msg.find("\"cpu\""), std::string::npos) << msg;
    }
  });
}

// A tensor on another device than the group's home reaching a collective is a Tessera bug:
// an internal error naming the call site, raised before anything is sent. A meta tensor
// stands in for "another device" on a machine without a GPU.
TEST(Devices, CollectivesRefuseTensorsAwayFromHome) {
  tessera::testing::run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto pg = mesh.group(0);
    const auto meta = at::empty({4}, at::TensorOptions().device(c10::DeviceType::Meta));
    struct Case {
      const char* site;
      std::function<void()> call;
    };
    const std::vector<Case> cases{
        {"all_gather",
         [&] {
           comm::all_gather(pg, meta, 0, {4, 4});
         }},
        {"all_reduce", [&] { comm::all_reduce(pg, meta, PartialOp::Sum); }},
        {"reduce_scatter",
         [&] {
           comm::reduce_scatter(pg, meta, 0, {2, 2}, PartialOp::Sum);
         }},
        {"broadcast", [&] { comm::broadcast(pg, meta, 0); }},
        {"all_reduce_start", [&] { comm::all_reduce_start(pg, meta, PartialOp::Sum); }},
        {"all_to_all_blocks",
         [&] {
           comm::all_to_all_blocks(pg, {meta, meta}, {{4}, {4}}, meta.options());
         }},
    };
    for (const auto& c : cases) {
      auto msg = error_of(c.call);
      EXPECT_NE(msg.find(std::string(c.site) + " was handed a tensor on meta"), std::string::npos)
          << c.site << ": " << msg;
      EXPECT_NE(msg.find("home is cpu"), std::string::npos) << msg;
    }
    // The group still works afterwards: nothing was sent.
    auto sum = comm::all_reduce(pg, at::ones({3}), PartialOp::Sum);
    EXPECT_TRUE(sum.equal(at::full({3}, 2.0)));
  });
}

// Metadata (shapes, verdicts, strings) is made by the collective layer itself on the wire's
// device; the answers come back as host values on every rank, 0 bytes included.
TEST(Devices, MetadataRoundTripsOnEveryGroupSize) {
  for (int n : {1, 2, 4}) {
    tessera::testing::run_ranks(n, [n](int rank) {
      auto pg = init_device_mesh("cpu", {n}).group(0);
      auto ints = comm::all_gather_ints(pg, {rank, 10 * rank});
      ASSERT_EQ(static_cast<int>(ints.size()), n);
      for (int r = 0; r < n; ++r) EXPECT_EQ(ints[r], (std::vector<int64_t>{r, 10 * r}));
      auto strings = comm::all_gather_strings(pg, std::string(static_cast<size_t>(rank), 'x'));
      for (int r = 0; r < n; ++r) EXPECT_EQ(strings[r], std::string(static_cast<size_t>(r), 'x'));
    });
  }
}

// As PyTorch's distribute_tensor and from_local: a tensor handed to a mesh moves to the mesh's
// device (here already there: the shards are the host tensors themselves). tests/gpu/ hands
// host tensors to CUDA meshes.
TEST(Devices, TensorsMoveToTheMeshDevice) {
  tessera::testing::run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto full = at::arange(12, at::kDouble).reshape({6, 2});
    auto x = distribute_tensor(full, mesh, {Shard(0)});
    EXPECT_EQ(x.device(), c10::Device(c10::DeviceType::CPU));
    auto y = from_local(to_local(x), mesh, {Shard(0)});
    EXPECT_TRUE(full_tensor(y).equal(full));
  });
}

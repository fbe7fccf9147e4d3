#pragma once
// Random numbers for distributed tensors: the generator that random ops on distributed tensors
// draw from, and how its state is made equal on every rank (docs/random.md; NOTE: [Random
// numbers] in ops/random.cpp).
//
// Each rank has one such generator per device type, separate from ATen's default generator
// that random ops on plain tensors use, so local random ops never move it. "Rank" means the
// calling thread's World (tessera::current_world()): one per process, or one per thread when
// ranks are threads (tessera::testing::run_ranks), so ranks as threads do not share it.
//
// Guarantee (when every rank runs the same random ops on distributed tensors and the same
// resets, in the same order, as with any collective): the generators of all ranks of the world
// hold the same state whenever a random op on a distributed tensor runs, so every rank draws
// the same global tensor and keeps its block:
// the values are those one device draws from that state, replicas are identical, and shards
// never repeat each other's numbers. The state agreed on is world rank 0's:
//  - a rank's generator starts as a copy of ATen's default generator (so at::manual_seed(s) on
//    every rank means what it means on one device), starts again from a copy after each later
//    re-seed of the default generator (at::manual_seed; NOTE: [Re-seeding]), and manual_seed /
//    clear_manual_seed below replace it;
//  - world rank 0 writes each new state of its generator (made, or reset) into the world's
//    store at once, without waiting for anyone; every other rank takes it at its next random op
//    on a distributed tensor after the same reset. Ranks seeded differently therefore draw what
//    one device seeded like rank 0 draws. The agreement is world-wide, not per mesh, because a
//    tensor on a submesh (mesh["tp"]) is a replica of the same tensor on the other submeshes
//    (across "dp").
// An op's explicit generator argument is used as given: keeping it equal on all ranks is then
// the caller's job.
#include <cstdint>

#include <ATen/core/Generator.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Optional.h>

namespace tessera {

class DeviceMesh;

// Seeds this rank's generators for random ops on distributed tensors (not ATen's default
// generator). Never waits (world rank 0 writes its seeded state into the store). Call it on
// every rank at the same point of the program: the next random op on a distributed tensor
// takes world rank 0's state (one read from the store), so an identical seed everywhere changes
// nothing and rank-dependent seeds mean rank 0's seed. Needs a world (after
// init_process_group, or inside run_ranks).
void manual_seed(uint64_t seed);

// Forgets manual_seed: this rank's generators start again from a copy of ATen's default
// generator, agreed on (rank 0's) at the next random op on a distributed tensor. Every rank
// calls it at the same point, as manual_seed.
void clear_manual_seed();

// Collective over `mesh` (every rank of it calls it; ranks outside it return at once): every
// rank of the mesh takes the generator state (for the mesh's device type) of mesh-local rank
// `src` (an index into mesh.ranks()), by one broadcast over the mesh. Afterwards no agreement
// is pending on these ranks.
// On a mesh spanning the world this is world-wide agreement on src's state. On a submesh such
// as mesh["tp"] each submesh agrees with its own src only, so replicas on different submeshes
// agree only if they agreed before: with rank-dependent seeds, call it on the whole mesh, or
// not at all (the next random op agrees world-wide by itself). Useful on a mesh that does not
// contain world rank 0 when rank 0 never touches its generator (no manual_seed, no random op on
// distributed tensors), and to pay for the agreement at a chosen point.
void sync_random_state(const DeviceMesh& mesh, int src = 0);

// This rank's generator for random ops on distributed tensors of `device` type, as it is (no
// agreement is made). Drawing from it advances it; for tests and for drawing on purpose what a
// distributed random op would draw.
at::Generator random_generator(c10::DeviceType device = c10::DeviceType::CPU);

// Former name of random_generator(CPU) (the generator used to be per thread and optional).
c10::optional<at::Generator> thread_generator();

namespace detail {
// What random ops on distributed tensors draw from: this rank's generator for `device`, after
// the world-wide agreement if one is pending (a store exchange; see above).
at::Generator agreed_generator(c10::DeviceType device);
}  // namespace detail

}  // namespace tessera

#pragma once
// Errors, not hangs: checks whose verdict can differ between ranks, settled on every rank at
// once. See NOTE: [Agreeing on arguments] in src/comm/agree.cpp.
#include <functional>
#include <string>
#include <vector>

#include "tessera/comm/collectives.h"

namespace tessera::comm {

struct Agreement {
  std::string error;          // this member's failed check, or empty
  std::string args;           // arguments that must match on every member ("" if none)
  std::vector<int64_t> ints;  // small values every member wants from every other
};

// "ranks 0, 2": how messages name group members (by default "group members 0, 2").
using MemberNames = std::function<std::string(const std::vector<size_t>& members)>;

// Every member's `ints`, once every member passed its checks and all passed the same `args`;
// otherwise every member raises the same c10::Error: the failed checks with the members that
// failed them, or the differing arguments. One small all-gather on the common path.
std::vector<std::vector<int64_t>> agree(const Group& pg, const char* what, const Agreement& mine,
                                        const MemberNames& names = {});

// agree() on a verdict alone: if any member's `ok` is false, every member throws the same
// c10::Error, carrying the failing members' messages.
void check_everywhere(const Group& pg, bool ok, const std::string& message);

}  // namespace tessera::comm

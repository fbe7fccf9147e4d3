// The agreement protocol: one verdict, one digest, a few ints per member.
#include "tessera/comm/agree.h"

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

namespace tessera::comm {

// NOTE: [Agreeing on arguments]
// Arguments are per rank, so a check on them can fail on some ranks only; a rank that throws
// alone leaves the others waiting in the next collective. The collective entry points
// (distribute_tensor with a source rank, scatter_tensor, from_local with run_check or Infer,
// redistribute to placements, checkpoint loads and saves) therefore run their local checks
// without throwing, then exchange one small message: each member's verdict, a digest of its
// arguments and a few ints the caller needs anyway (its tensor's rank and dtype, ...). A failed
// check or arguments that differ are then raised on every member, before any member starts
// the real collectives.

namespace {

using TextGroups = std::vector<std::pair<std::string, std::vector<size_t>>>;

// Members with the same text, in first-seen order.
TextGroups group_texts(const std::vector<std::string>& texts, const std::vector<bool>& include) {
  TextGroups groups;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (!include[i]) continue;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == texts[i]; });
    if (it == groups.end())
      groups.push_back({texts[i], {i}});
    else
      it->second.push_back(i);
  }
  return groups;
}

std::string default_names(const std::vector<size_t>& members) {
  std::string s = members.size() == 1 ? "group member " : "group members ";
  for (size_t i = 0; i < members.size(); ++i) s += (i ? ", " : "") + std::to_string(members[i]);
  return s;
}

// The rare path: every member learns why the others failed, or what they passed.
[[noreturn]] void raise_disagreement(const Group& pg, const char* what, const Agreement& mine,
                                     const std::vector<std::vector<int64_t>>& all,
                                     const MemberNames& names) {
  auto texts = all_gather_strings(pg, mine.error.empty() ? mine.args : mine.error);
  const size_t n = all.size();
  std::vector<bool> failed(n);
  bool ok = true;
  for (size_t i = 0; i < n; ++i) {
    failed[i] = all[i][0] == 0;
    ok = ok && !failed[i];
  }
  if (!ok) {
    auto groups = group_texts(texts, failed);
    size_t count = 0;
    for (auto& g : groups) count += g.second.size();
    // Every member failed the same check: the error as one member alone would raise it.
    TORCH_CHECK(!(groups.size() == 1 && count == n), groups[0].first);
    std::string msg;
    for (auto& g : groups)
      msg += (msg.empty() ? "" : "; ") + g.first + " [on " + names(g.second) + "]";
    TORCH_CHECK(false, msg, count < n ? " (the others passed these checks)" : std::string());
  }
  std::string msg;
  for (auto& g : group_texts(texts, std::vector<bool>(n, true)))
    msg += (msg.empty() ? "" : "; ") + names(g.second) + " passed " + g.first;
  TORCH_CHECK(false, "tessera: ", what,
              ": the ranks disagree on the arguments, which must be the same on every rank: ", msg);
}

}  // namespace

std::vector<std::vector<int64_t>> agree(const Group& pg, const char* what, const Agreement& mine,
                                        const MemberNames& names) {
  std::vector<int64_t> message{mine.error.empty() ? 1 : 0,
                               static_cast<int64_t>(std::hash<std::string>()(mine.args))};
  message.insert(message.end(), mine.ints.begin(), mine.ints.end());
  auto all = all_gather_ints(pg, message);
  bool ok = true, same = true;
  std::vector<std::vector<int64_t>> ints;
  for (auto& v : all) {
    ok = ok && v[0] == 1;
    same = same && v[1] == all[0][1];
    ints.emplace_back(v.begin() + 2, v.end());
  }
  if (!ok || !same) raise_disagreement(pg, what, mine, all, names ? names : default_names);
  return ints;
}

void check_everywhere(const Group& pg, bool ok, const std::string& message) {
  (void)agree(pg, "check", {ok ? std::string() : message, {}, {}});
}

}  // namespace tessera::comm

#include "server/partition_state.h"

#include <algorithm>
#include <cstring>

#include "common/naming.h"
#include "reduce/reduce.h"

namespace gradlink::server {

PartitionState::PartitionState(uint64_t key, uint32_t partition, std::string name, DataType dtype,
                               uint64_t count, std::vector<uint32_t> contributors,
                               uint32_t workers, std::vector<uint32_t> host_of,
                               Routing routing, BufferPool* pool)
    : pool_(pool),
      key_(key),
      partition_(partition),
      name_(std::move(name)),
      dtype_(dtype),
      count_(count),
      contributors_(std::move(contributors)),
      num_workers_(static_cast<uint32_t>(contributors_.size())),
      routing_(std::move(routing)),
      participants_(contributors_),
      divisor_(workers),
      host_of_(std::move(host_of)),
      wire_bytes_(count * DataTypeSize(dtype)),
      // A relayed push keeps its dtype: no accumulator to widen into.
      acc_bytes_(routing_.copy ? wire_bytes_
                               : count * DataTypeSize(reduce::AccumulatorType(dtype))) {
  participants_.insert(participants_.end(), routing_.requesters.begin(),
                       routing_.requesters.end());
  num_part_ = static_cast<uint32_t>(participants_.size());
  stage_.assign(num_part_, Stage::kFree);
  cookie_.assign(num_part_, 0);
  flags_.assign(num_part_, 0);
  gone_.assign(num_part_, false);
  joined_.assign(num_part_, false);
  ranks_.assign(num_part_, 0);
  if (!host_of_.empty()) {
    host_ranks_.assign(num_workers_, 0);
    host_joined_.assign(num_workers_, 0);
    rank_joined_.assign(host_of_.size(), false);
    for (uint32_t h : host_of_) {
      if (h < num_workers_) ++host_ranks_[h];
    }
  }
  staging_.resize(num_workers_);
  left_ = participants_;
  for (uint32_t i = 0; i < num_part_; ++i) {
    const uint32_t r = participants_[i];
    if (r >= index_of_.size()) index_of_.resize(r + 1, -1);
    index_of_[r] = static_cast<int32_t>(i);
  }
}

std::string PartitionState::Describe() const {
  return "key " + KeyHex(key_) + " '" + name_ + "' partition " + std::to_string(partition_);
}

uint64_t PartitionState::round() const {
  MutexLock lock(mu_);
  return round_;
}

std::optional<PartitionState::Waiting> PartitionState::Stalled(Clock::time_point now,
                                                               Clock::duration after) const {
  MutexLock lock(mu_);
  if (first_push_ == Clock::time_point{} || now - first_push_ < after || adopting_) {
    return std::nullopt;
  }
  Waiting w;
  w.round = round_;
  w.age = now - first_push_;
  for (uint32_t i = 0; i < num_part_; ++i) {
    // Sitting out (joined), left, or failed (a joined rank of another collective): neither.
    if (stage_[i] == Stage::kAbsent || stage_[i] == Stage::kFailed || gone_[i]) continue;
    (stage_[i] == Stage::kFree ? w.missing : w.pushed).push_back(participants_[i]);
  }
  if (w.missing.empty()) return std::nullopt;  // all in: summing or sending, not stalled
  std::sort(w.missing.begin(), w.missing.end());
  std::sort(w.pushed.begin(), w.pushed.end());
  return w;
}

Result<std::span<std::byte>> PartitionState::BeginPush(const wire::Header& h, bool* run_engine) {
  *run_engine = false;
  MutexLock lock(mu_);
  const uint32_t sender = h.sender;
  const int32_t index = IndexOf(sender);
  if (index < 0) {
    return ProtocolError(Describe() + ": push from rank " + std::to_string(sender) +
                         ", which does not push this partition" +
                         (host_of_.empty() ? std::string()
                                                   : " (each host's partial sum comes from one rank)"));
  }
  const uint32_t rank = static_cast<uint32_t>(index);
  // A requester pushes nothing: its push only asks for the result.
  const bool requester = rank >= num_workers_;
  const uint64_t expected = requester ? 0 : count_;
  if (adopting_) {
    if (h.count == expected && stage_[rank] == Stage::kFree) push_round_[rank] = h.round;
  } else if (h.round != round_) {
    return ProtocolError(Describe() + ": rank " + std::to_string(sender) + " pushed round " +
                         std::to_string(h.round) + " while the server sums round " +
                         std::to_string(round_));
  }
  if (stage_[rank] == Stage::kAbsent) {
    return ProtocolError(Describe() + ": rank " + std::to_string(sender) + " pushed round " +
                         std::to_string(h.round) + " after it joined");
  }
  if (stage_[rank] != Stage::kFree) {
    return ProtocolError(Describe() + ": rank " + std::to_string(sender) + " pushed round " +
                         std::to_string(h.round) + " twice");
  }
  const uint32_t most = rank < host_ranks_.size() ? host_ranks_[rank] : 0;
  if (h.ranks > most) {
    return ProtocolError(Describe() + ": rank " + std::to_string(sender) + " pushed a sum of " +
                         std::to_string(h.ranks) + " ranks" +
                         (most == 0 ? std::string(", which only a host's partial sum names")
                                    : " for a host of " + std::to_string(most)));
  }
  cookie_[rank] = h.cookie;
  flags_[rank] = h.flags;
  ranks_[rank] = h.ranks;
  if (h.dtype != static_cast<uint8_t>(dtype_) || h.count != expected) {
    const std::string got =
        IsValidDataType(h.dtype) ? std::string(DataTypeName(static_cast<DataType>(h.dtype)))
                                 : "dtype " + std::to_string(h.dtype);
    if (failure_.empty()) {
      failure_ = Describe() + ": rank " + std::to_string(sender) + " pushed " + got + "[" +
                 std::to_string(h.count) + "], declared " + std::string(DataTypeName(dtype_)) +
                 "[" + std::to_string(count_) + "]" +
                 (requester ? " (of which it pushes none: it only receives)" : "");
      failure_code_ = Code::kMismatch;
    }
    stage_[rank] = Stage::kFailed;
    *run_engine = true;
    return Mismatch(failure_);
  }
  stage_[rank] = Stage::kReceiving;
  if (first_push_ == Clock::time_point{}) first_push_ = Clock::now();
  if (requester) return std::span<std::byte>();
  // Rank 0 comes first in the sum, so where the accumulator has the wire dtype its push can land
  // in the accumulator itself (acc = s0; acc += s1 gives the same bits as acc = s0 + s1): one
  // staging buffer fewer per partition. Not while round-2's result is still going out of that
  // accumulator: then rank 0 is staged like the others.
  const uint32_t slot = static_cast<uint32_t>(round_ % 2);
  const bool direct =
      rank == 0 && acc_bytes_ == wire_bytes_ && sends_pending_[slot] == 0 && !adopting_;
  if (rank == 0) direct_ = direct;
  std::vector<std::byte>& buf = direct ? acc_[slot] : staging_[rank];
  Take(buf, direct ? acc_bytes_ : wire_bytes_);
  return std::span<std::byte>(buf);
}

bool PartitionState::EndPush(uint32_t sender, bool ok) {
  MutexLock lock(mu_);
  const int32_t index = IndexOf(sender);
  if (index < 0 || stage_[index] != Stage::kReceiving) return false;
  const uint32_t rank = static_cast<uint32_t>(index);
  if (ok) {
    stage_[rank] = Stage::kStaged;
    last_landed_ = Clock::now();
  } else {
    stage_[rank] = Stage::kFailed;
    if (failure_.empty()) {
      failure_ = Describe() + ": the push of rank " + std::to_string(sender) + " failed to arrive";
      failure_code_ = Code::kPeerLost;
    }
  }
  // Adopting, a push may be the last thing the adoption waits for (a worker that reported the
  // latest result pushes nothing more): Progress() finishes it and answers that push.
  if (adopting_) return AdoptionReadyLocked();
  // While the engine sums ranks [next_, last) they are still kStaged and next_ is not yet
  // advanced, so this errs towards true; a false is exact: Progress() would change nothing.
  return SummableEndLocked() > next_ || RoundOverLocked();
}

uint32_t PartitionState::SummableEndLocked() const {
  uint32_t last = next_;
  uint32_t staged = 0;
  while (failure_.empty() && last < num_workers_ &&
         (stage_[last] == Stage::kStaged || stage_[last] == Stage::kAbsent)) {
    staged += stage_[last] == Stage::kStaged ? 1 : 0;
    ++last;
  }
  // The first step takes two pushes together (acc = s0 + s1) while a second is still to come.
  if (!acc_started_ && staged == 1) {
    for (uint32_t i = last; i < num_workers_; ++i) {
      if (stage_[i] != Stage::kAbsent) return next_;
    }
  }
  return staged == 0 ? next_ : last;
}

bool PartitionState::RoundOverLocked() const {
  // A failed round sums nothing more: staged pushes only wait for the others. A requester's
  // push (nothing to sum) is done once it has arrived. A round that every participant sits
  // out, or fails only by having joined, has not begun: nobody is there to answer, and
  // completing it would start the next one the same way, round after round, holding the
  // owner thread (and the join release queued behind it) forever.
  bool begun = false;
  for (uint32_t i = 0; i < num_part_; ++i) {
    const Stage s = stage_[i];
    if (s == Stage::kAbsent) continue;
    if (!(s == Stage::kSummed || s == Stage::kFailed ||
          (s == Stage::kStaged && (!failure_.empty() || i >= num_workers_)))) {
      return false;
    }
    begun = begun || !(s == Stage::kFailed && joined_[i]);
  }
  return begun;
}

void PartitionState::ApplyJoinedLocked() {
  if (joined_count_ == 0) return;
  for (uint32_t i = 0; i < num_part_; ++i) {
    if (!joined_[i] || stage_[i] != Stage::kFree) continue;
    if (SumsWithoutAbsent()) {
      stage_[i] = Stage::kAbsent;
      continue;
    }
    stage_[i] = Stage::kFailed;
    if (failure_.empty()) {
      failure_ = Describe() + " round " + std::to_string(round_) + ": rank " +
                 std::to_string(participants_[i]) +
                 " has joined (join()): only sums and averages run while a rank has joined";
      failure_code_ = Code::kInvalidArgument;
    }
  }
}

bool PartitionState::SetJoined(uint32_t worker, bool joined) {
  MutexLock lock(mu_);
  if (host_of_.empty()) return SetJoinedLocked(IndexOf(worker), joined);
  // Summed per host first: the host sits a round out only once all its workers have joined;
  // until then its pusher (joined or not) pushes what the others summed, naming how many.
  if (worker >= rank_joined_.size() || host_of_[worker] >= num_workers_ ||
      rank_joined_[worker] == joined) {
    return false;
  }
  const uint32_t host = host_of_[worker];
  rank_joined_[worker] = joined;
  if (joined) {
    if (++host_joined_[host] < host_ranks_[host]) return false;
    return SetJoinedLocked(static_cast<int32_t>(host), true);
  }
  --host_joined_[host];
  return SetJoinedLocked(static_cast<int32_t>(host), false);
}

bool PartitionState::SetJoinedLocked(int32_t index, bool joined) {
  if (index < 0 || joined_[index] == joined) return false;
  if (joined) {
    joined_[index] = true;
    ++joined_count_;
    ApplyJoinedLocked();
    return true;
  }
  // Every rank has joined: nothing is in flight, and the round not yet begun starts afresh
  // (a collective's round that failed only because ranks had joined, nobody having pushed).
  bool pushed = false;
  for (uint32_t i = 0; i < num_part_; ++i) {
    pushed = pushed || (stage_[i] != Stage::kFree && stage_[i] != Stage::kAbsent &&
                        !(stage_[i] == Stage::kFailed && joined_[i]));
  }
  joined_[index] = false;
  --joined_count_;
  if (stage_[index] == Stage::kAbsent) stage_[index] = Stage::kFree;
  if (!pushed && failure_code_ == Code::kInvalidArgument && !failure_.empty()) {
    failure_.clear();
    for (uint32_t i = 0; i < num_part_; ++i) {
      if (stage_[i] == Stage::kFailed) stage_[i] = Stage::kFree;
    }
    ApplyJoinedLocked();  // the ranks still marked joined (SetJoined(false) comes per rank)
  }
  return false;
}

void PartitionState::Adopt() {
  MutexLock lock(mu_);
  adopting_ = true;
  reported_.assign(num_part_, 0);
  reported_round_.assign(num_part_, 0);
  push_round_.assign(num_part_, 0);
  has_result_.assign(num_part_, false);
  input_follows_.assign(num_part_, false);
  reported_result_.resize(num_part_);
}

bool PartitionState::adopting() const {
  MutexLock lock(mu_);
  return adopting_;
}

Result<std::span<std::byte>> PartitionState::BeginRecover(const wire::Header& h) {
  MutexLock lock(mu_);
  const int32_t index = IndexOf(h.sender);
  if (!adopting_ || index < 0 || reported_[index] != 0) {
    return ProtocolError(Describe() + ": kRecover from rank " + std::to_string(h.sender) +
                         (adopting_ ? (index < 0 ? ", which does not push this partition"
                                                 : " twice")
                                    : " for a partition this server was not given by failover"));
  }
  const bool result = (h.flags & wire::kFlagHasResult) != 0;
  if (h.round == UINT64_MAX) {  // the round after it would wrap
    return ProtocolError(Describe() + ": kRecover from rank " + std::to_string(h.sender) +
                         " names round " + std::to_string(h.round));
  }
  if (h.dtype != static_cast<uint8_t>(dtype_) || h.count != (result ? count_ : 0)) {
    return ProtocolError(Describe() + ": kRecover from rank " + std::to_string(h.sender) +
                         " of " + std::to_string(h.count) + " elements, declared " +
                         std::to_string(count_));
  }
  const uint32_t i = static_cast<uint32_t>(index);
  reported_[i] = 1;
  reported_round_[i] = h.round;
  has_result_[i] = result;
  input_follows_[i] = (h.flags & wire::kFlagInputFollows) != 0;
  if (!result) return std::span<std::byte>();
  Take(reported_result_[i], wire_bytes_);
  return std::span<std::byte>(reported_result_[i]);
}

bool PartitionState::EndRecover(uint32_t sender, bool ok) {
  MutexLock lock(mu_);
  const int32_t index = IndexOf(sender);
  if (!adopting_ || index < 0 || reported_[index] != 1) return false;
  reported_[index] = 2;
  if (!ok && failure_.empty()) {
    failure_ = Describe() + ": the failover report of rank " + std::to_string(sender) +
               " failed to arrive";
    failure_code_ = Code::kPeerLost;
  }
  return AdoptionReadyLocked();
}

bool PartitionState::AdoptionReadyLocked() const {
  for (uint32_t i = 0; i < num_part_; ++i) {
    if (reported_[i] != 2) return false;
    if (input_follows_[i] && stage_[i] != Stage::kStaged && stage_[i] != Stage::kFailed) {
      return false;
    }
  }
  return true;
}

std::optional<Completion> PartitionState::FinishAdoptionLocked() {
  adopting_ = false;
  // The latest result any worker holds, and the round each worker would push next.
  std::optional<uint32_t> holder;
  uint64_t base = 0;
  for (uint32_t i = 0; i < num_part_; ++i) {
    if (has_result_[i] && (!holder || reported_round_[i] > reported_round_[*holder])) holder = i;
    if (!has_result_[i]) base = std::max(base, reported_round_[i]);
  }
  if (holder) base = std::max(base, reported_round_[*holder] + 1);
  const uint64_t latest = holder ? reported_round_[*holder] : 0;
  // Every copy of the latest result is the same bits (a worker's copy is what it received).
  for (uint32_t i = 0; i < num_part_ && holder; ++i) {
    if (i == *holder || !has_result_[i] || reported_round_[i] != latest) continue;
    if (reported_result_[i] != reported_result_[*holder] && failure_.empty()) {
      failure_ = Describe() + ": ranks " + std::to_string(participants_[*holder]) + " and " +
                 std::to_string(participants_[i]) + " hold different results of round " +
                 std::to_string(latest);
      failure_code_ = Code::kInternal;
    }
  }
  Completion c;
  c.round = latest;
  c.slot = static_cast<uint32_t>(latest % 2);
  c.absent.assign(num_part_, true);
  uint32_t answered = 0;
  for (uint32_t i = 0; i < num_part_; ++i) {
    if (stage_[i] != Stage::kStaged) continue;
    if (holder && push_round_[i] == latest) {  // it did not receive the latest result: it gets it
      c.absent[i] = false;
      ++answered;
      Give(staging_[i]);
      stage_[i] = Stage::kFree;
    } else if (push_round_[i] != base && failure_.empty()) {
      failure_ = Describe() + ": after failover rank " + std::to_string(participants_[i]) +
                 " pushed round " + std::to_string(push_round_[i]) + ", the others are at round " +
                 std::to_string(base);
      failure_code_ = Code::kInternal;
      if (!SumsWithoutAbsent()) {
        // Only a sum's workers keep its results: another collective's round that some had
        // received when its server was lost cannot be answered to the others.
        failure_ += " (a round of this collective was in flight when its server was lost, and "
                    "only sums can be replayed)";
        failure_code_ = Code::kPeerLost;
      }
    }
  }
  round_ = base;
  next_ = 0;
  const bool failed = !failure_.empty();
  // A failover that went wrong fails the round after it too, for every worker: none waits.
  for (uint32_t i = 0; i < num_part_ && failed; ++i) {
    if (stage_[i] == Stage::kFree) stage_[i] = Stage::kFailed;
  }
  // Pushes that came while adopting are this round's: the stall inspector counts from now.
  first_push_ = std::any_of(stage_.begin(), stage_.end(),
                            [](Stage st) { return st == Stage::kReceiving || st == Stage::kStaged; })
                    ? Clock::now()
                    : Clock::time_point{};
  const bool keep = answered > 0 && !failed;
  for (uint32_t i = 0; i < num_part_; ++i) {
    if (!(keep && i == *holder)) Give(reported_result_[i]);
  }
  if (answered == 0) return std::nullopt;
  if (failed) {
    c.status = Status(failure_code_, failure_);
  } else {
    out_[c.slot] = std::move(reported_result_[*holder]);
    reported_result_[*holder] = std::vector<std::byte>();
    c.result = out_[c.slot];
  }
  sent_cookies_[c.slot].assign(cookie_.begin(), cookie_.end());
  c.cookies = sent_cookies_[c.slot];
  sends_pending_[c.slot] = answered;
  return c;
}

std::optional<Completion> PartitionState::Progress() {
  uint32_t slot;
  uint32_t first, last;  // ranks [first, last) to add now
  bool direct;           // rank 0's push is in the accumulator
  bool started;          // acc_started_: written back under mu_ once summed
  {
    MutexLock lock(mu_);
    if (adopting_) {
      if (!AdoptionReadyLocked()) return std::nullopt;
      if (std::optional<Completion> answered = FinishAdoptionLocked()) return answered;
    }
    slot = static_cast<uint32_t>(round_ % 2);
    if (sends_pending_[slot] != 0) return std::nullopt;  // round-2's result still going out
    first = next_;
    last = SummableEndLocked();
    direct = direct_;
    started = acc_started_;
  }

  std::vector<std::byte>& acc = acc_[slot];
  if (last > first) {
    // Only this thread writes a stage to or from kAbsent (SetJoined, the round's reset), and
    // staged pushes stay staged until the loop below: reading them unlocked is safe.
    Take(acc, acc_bytes_);
    const ReduceOp op = routing_.op;
    const auto present = [&](uint32_t i) { return StagedPresent(i); };
    for (uint32_t r = first; r < last; ++r) {
      if (!present(r)) continue;
      if (started) {
        reduce::Fold(op, dtype_, acc.data(), staging_[r].data(), count_);
        continue;
      }
      started = true;
      if (r == 0 && direct) continue;  // rank 0's push is in the accumulator already
      if (routing_.copy) {
        std::memcpy(acc.data(), staging_[r].data(), wire_bytes_);
        continue;
      }
      uint32_t second = r + 1;
      while (second < last && !present(second)) ++second;
      if (second == last || op != ReduceOp::kSum) {
        reduce::Load(dtype_, acc.data(), staging_[r].data(), count_);
      } else {
        reduce::SumTwo(dtype_, acc.data(), staging_[r].data(), staging_[second].data(), count_);
        r = second;
      }
    }
    // Summed: the pushes' staging goes back for other rounds (this rank's next push comes
    // only after this round's reply).
    for (uint32_t r = first; r < last; ++r) Give(staging_[r]);
  }

  MutexLock lock(mu_);
  acc_started_ = started;
  for (uint32_t r = first; r < last; ++r) {
    if (stage_[r] != Stage::kAbsent) stage_[r] = Stage::kSummed;
  }
  next_ = std::max(next_, last);
  // The round is over when every rank has either been summed or failed.
  if (!RoundOverLocked()) return std::nullopt;

  Completion c;
  c.round = round_;
  c.slot = slot;
  c.server_time = Clock::now() - last_landed_;
  // Kept per slot (its capacity reused: no allocation per round) while the replies go out.
  sent_cookies_[slot].assign(cookie_.begin(), cookie_.end());
  c.cookies = sent_cookies_[slot];
  uint32_t absent = 0, first_present = 0;
  if (joined_count_ != 0) {  // else no allocation: `absent` stays empty
    c.absent.assign(num_part_, false);
    for (uint32_t i = 0; i < num_part_; ++i) {
      // Sat the round out, or failed it only by having joined: no reply either way.
      c.absent[i] = stage_[i] == Stage::kAbsent || (joined_[i] && stage_[i] == Stage::kFailed);
      absent += c.absent[i] ? 1 : 0;
    }
    while (first_present + 1 < num_part_ && c.absent[first_present]) ++first_present;
  }
  const auto sat_out = [&](uint32_t i) { return !c.absent.empty() && c.absent[i]; };
  if (!failure_.empty()) {
    c.status = Status(failure_code_, failure_);
  } else {
    const uint16_t f0 = flags_[first_present];
    for (uint32_t r = 0; r < num_workers_ && c.status.ok(); ++r) {
      if (!sat_out(r) && (flags_[r] & wire::kFlagHostDisagrees)) {
        c.status = Mismatch(Describe() + " round " + std::to_string(round_) +
                            ": the workers on the host of rank " +
                            std::to_string(contributors_[r]) + " disagree on averaging");
      }
    }
    if ((f0 & wire::kFlagAverage) && (routing_.copy || routing_.op != ReduceOp::kSum)) {
      c.status = InvalidArgument(Describe() + " round " + std::to_string(round_) + ": rank " +
                                 std::to_string(participants_[first_present]) +
                                 " asked for an average, which only a sum has");
    }
    for (uint32_t r = first_present + 1; r < num_part_ && c.status.ok(); ++r) {
      if (!sat_out(r) && flags_[r] != f0) {
        c.status = Mismatch(Describe() + " round " + std::to_string(round_) + ": rank " +
                            std::to_string(participants_[first_present]) + " " +
                            ((f0 & wire::kFlagAverage) ? "averages" : "sums") + " but rank " +
                            std::to_string(participants_[r]) + " " +
                            ((flags_[r] & wire::kFlagAverage) ? "averages" : "sums"));
        break;
      }
    }
  }
  if (c.status.ok()) {
    // An average divides by every rank, those that sat the round out (Worker::Join) included:
    // they add zeros, as under Horovod's join and torch's Join (divide_by_initial_world_size).
    const uint32_t divisor = (flags_[first_present] & wire::kFlagAverage) ? divisor_ : 1;
    if (routing_.copy) {
      c.result = acc;  // the contributor's push, as it came
    } else if (acc_bytes_ == wire_bytes_) {
      reduce::Store(dtype_, acc.data(), acc.data(), count_, divisor);
      c.result = acc;
    } else {
      std::vector<std::byte>& out = out_[slot];
      Take(out, wire_bytes_);
      reduce::Store(dtype_, out.data(), acc.data(), count_, divisor);
      c.result = out;
    }
  }
  sends_pending_[slot] = num_part_ - absent;
  direct_ = false;
  acc_started_ = false;
  ++round_;
  first_push_ = {};
  next_ = 0;
  failure_.clear();
  std::fill(stage_.begin(), stage_.end(), Stage::kFree);
  ApplyJoinedLocked();
  // A round that needs a rank that left fails at once, naming it; but once every contributor
  // has left there is nobody to tell, and failing each next round at once would only complete
  // round after round (their sends fail as fast), never letting go of the engine.
  if (!std::all_of(gone_.begin(), gone_.end(), [](bool g) { return g; })) {
    for (uint32_t r = 0; r < num_part_; ++r) {
      if (gone_[r]) FailRankLocked(r);
    }
  }
  return c;
}

void PartitionState::Take(std::vector<std::byte>& buf, size_t bytes) {
  if (buf.size() == bytes) return;
  held_.fetch_add(bytes - buf.size(), std::memory_order_relaxed);
  if (pool_ != nullptr && buf.empty()) {
    buf = pool_->Take(bytes);
  } else {
    buf.resize(bytes);
  }
}

void PartitionState::Give(std::vector<std::byte>& buf) {
  if (pool_ == nullptr || buf.empty()) return;  // without a pool, buffers stay for later rounds
  held_.fetch_sub(buf.size(), std::memory_order_relaxed);
  pool_->Give(buf);
}

void PartitionState::FailRankLocked(uint32_t index) {
  stage_[index] = Stage::kFailed;
  if (failure_.empty()) {
    failure_ = Describe() + " round " + std::to_string(round_) + ": worker " +
               std::to_string(left_[index]) + " left the job before " +
               (index >= num_workers_ ? std::string("asking for it")
                : left_[index] == contributors_[index]
                    ? std::string("pushing it")
                    : "its host's partial sum was pushed (by rank " +
                          std::to_string(contributors_[index]) + ")");
    failure_code_ = Code::kAborted;
  }
}

bool PartitionState::MarkGone(uint32_t worker) {
  MutexLock lock(mu_);
  const int32_t index = host_of_.empty() ? IndexOf(worker)
                        : worker < host_of_.size() && host_of_[worker] < num_part_
                            ? static_cast<int32_t>(host_of_[worker])
                            : -1;
  if (index >= 0 && !gone_[index]) left_[index] = worker;
  if (index < 0 || gone_[index]) return false;
  const uint32_t rank = static_cast<uint32_t>(index);
  gone_[rank] = true;
  // A push already on its way or in belongs to this round, which may still complete.
  if (stage_[rank] == Stage::kFree) FailRankLocked(rank);
  return true;
}

bool PartitionState::WaitsForSlot(uint32_t slot) const {
  MutexLock lock(mu_);
  return round_ % 2 == slot;
}

bool PartitionState::SendDone(uint32_t slot) {
  MutexLock lock(mu_);
  if (slot > 1 || sends_pending_[slot] == 0) return false;
  if (--sends_pending_[slot] != 0) return false;
  // Every reply is out: the round's accumulator and result go back (under mu_, so that the
  // round two later, which takes them again, cannot start before).
  Give(acc_[slot]);
  Give(out_[slot]);
  return true;
}

}  // namespace gradlink::server

// Device memory (--pjrt_memory=device): each segment a PJRT buffer on its
// device, the arena its host copy.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/pjrt_chip.h"
#include "daemon/backends/pjrt/pjrt_op.h"
#include "daemon/backends/pjrt/plan.h"

namespace tpud::pjrt {

absl::StatusOr<PjrtChip::Mirror*> PjrtChip::MirrorOf(const ResolvedTensor& seg,
                                                     int device) {
  auto it = mirrors_.find(seg.segment_address);
  if (it != mirrors_.end() && it->second.bytes == seg.segment_bytes &&
      it->second.owner == seg.owner && it->second.device == device) {
    return &it->second;
  }
  // Nothing else may cover these pages now: a copy that does is of memory
  // freed since (releases are read before an op resolves its tensors), and
  // is dropped unread.
  Drop(seg.segment_address, seg.segment_bytes);
  absl::StatusOr<Buffer> b =
      plugin_->FromHost(device, seg.segment_host_base, PJRT_Buffer_Type_U8,
                        {static_cast<int64_t>(seg.segment_bytes)});
  if (!b.ok()) return b.status();
  Mirror m;
  m.buffer = *std::move(b);
  m.host = seg.segment_host_base;
  m.bytes = seg.segment_bytes;
  m.owner = seg.owner;
  m.device = device;
  m.host_current = true;
  device_bytes_ += m.bytes;
  return &mirrors_.emplace(seg.segment_address, std::move(m)).first->second;
}

void PjrtChip::Drop(uint64_t address, uint64_t bytes) {
  auto it = mirrors_.upper_bound(address);
  if (it != mirrors_.begin() &&
      std::prev(it)->first + std::prev(it)->second.bytes > address)
    --it;
  while (it != mirrors_.end() && it->first < address + bytes) {
    device_bytes_ -= it->second.bytes;
    it = mirrors_.erase(it);
  }
}

absl::Status PjrtChip::HostAccess(uint64_t address, uint64_t bytes, bool write,
                                  uint64_t owner) {
  if (!device_memory_ || bytes == 0) return absl::OkStatus();
  auto it = mirrors_.upper_bound(address);
  if (it != mirrors_.begin() &&
      std::prev(it)->first + std::prev(it)->second.bytes > address)
    --it;
  while (it != mirrors_.end() && it->first < address + bytes) {
    Mirror& m = it->second;
    if (m.owner == owner && !m.host_current) {
      if (absl::Status st = plugin_->ToHost(m.buffer, m.host, m.bytes);
          !st.ok()) {
        return absl::Status(
            st.code(),
            absl::StrCat("copying device memory at 0x", absl::Hex(it->first),
                         " to the host: ", st.message()));
      }
      m.host_current = true;
    }
    // Another session's copy is of pages freed since: dropped unread. One
    // the host writes is the arena's from now on.
    if (m.owner != owner || write) {
      device_bytes_ -= m.bytes;
      it = mirrors_.erase(it);
      continue;
    }
    ++it;
  }
  return absl::OkStatus();
}

void PjrtChip::Released(uint64_t address, uint64_t bytes) {
  if (device_memory_) Drop(address, bytes);
}

absl::Status PjrtChip::HostAccessAll(
    const std::vector<ResolvedTensor>& tensors) {
  for (const ResolvedTensor& t : tensors) {
    if (t.segment_bytes == 0) continue;
    if (absl::Status st =
            HostAccess(t.segment_address, t.segment_bytes, false, t.owner);
        !st.ok())
      return st;
  }
  return absl::OkStatus();
}

absl::Status PjrtChip::RunDevice(
    const std::string& name, const Plan& plan,
    const std::vector<ResolvedTensor>& tensors, int device,
    const std::function<const char*(size_t input)>& data_of,
    absl::Span<const int64_t> offsets) {
  auto named = [&](const absl::Status& st) {
    return absl::Status(st.code(), absl::StrCat(name, ": ", st.message()));
  };
  absl::InlinedVector<PJRT_Buffer*, 8> args;
  absl::InlinedVector<Mirror*, 4> segs;
  for (const Plan::Seg& s : plan.segs) {
    if (s.k < 0 || static_cast<size_t>(s.k) >= tensors.size() ||
        tensors[s.k].segment_bytes == 0) {
      return absl::InternalError(
          absl::StrCat(name, ": a segment parameter without a segment"));
    }
    absl::StatusOr<Mirror*> m = MirrorOf(tensors[s.k], device);
    if (!m.ok()) return named(m.status());
    segs.push_back(*m);
    args.push_back((*m)->buffer.get());
  }
  // A segment named twice would be donated while also read.
  for (size_t a = 0; a < segs.size(); ++a) {
    for (size_t b = 0; b < a; ++b) {
      if (segs[a] == segs[b])
        return absl::InternalError(
            absl::StrCat(name, ": a segment passed twice"));
    }
  }
  absl::InlinedVector<Buffer, 4> inputs;
  if (scalars_.size() >= 4096) scalars_.clear();
  for (size_t i = 0; i < plan.inputs.size(); ++i) {
    const Plan::In& x = plan.inputs[i];
    const char* at = data_of(i);
    if (at != nullptr) {
      absl::StatusOr<Buffer> b =
          plugin_->FromHost(device, at, x.type->pjrt, x.dims, x.byte_strides);
      if (!b.ok()) return named(b.status());
      args.push_back(b->get());
      inputs.push_back(*std::move(b));
      continue;
    }
    absl::StatusOr<PJRT_Buffer*> b = ScalarBuffer(device, x);
    if (!b.ok()) return named(b.status());
    args.push_back(*b);
  }
  for (int64_t offset : offsets) {
    absl::StatusOr<PJRT_Buffer*> b = OffsetBuffer(device, offset);
    if (!b.ok()) return named(b.status());
    args.push_back(*b);
  }
  absl::StatusOr<std::vector<Buffer>> out =
      plugin_->Execute(*plan.exe, device, absl::MakeConstSpan(args));
  if (!out.ok()) {
    // A donated segment may be gone with the failed run: what the host has
    // of it is all there is now.
    for (size_t j = 0; j < segs.size(); ++j) {
      if (plan.segs[j].result >= 0)
        Drop(tensors[plan.segs[j].k].segment_address, segs[j]->bytes);
    }
    return named(out.status());
  }
  const size_t want =
      static_cast<size_t>(plan.segments_written) + (plan.checked ? 1 : 0);
  if (out->size() != want) {
    return absl::InternalError(absl::StrCat(
        name, ": the program gave ", out->size(), " results for ", want));
  }
  // Each written segment's new buffer replaces the donated one.
  for (size_t j = 0; j < segs.size(); ++j) {
    const int r = plan.segs[j].result;
    if (r < 0) continue;
    segs[j]->buffer = std::move((*out)[r]);
    segs[j]->host_current = false;
  }
  if (plan.checked) {
    uint8_t bad = 0;
    if (absl::Status st = plugin_->ToHost(out->back(), &bad, 1); !st.ok())
      return named(st);
    if (bad != 0)
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", plan.range_message));
  }
  return absl::OkStatus();
}

absl::StatusOr<PJRT_Buffer*> PjrtChip::ScalarBuffer(int device,
                                                    const Transfer& x) {
  const void* data = x.type->is_float ? static_cast<const void*>(&x.scalar_d)
                                      : static_cast<const void*>(&x.scalar_i);
  std::string id(1, static_cast<char>(device));
  id.push_back(static_cast<char>(x.type->pjrt));
  id.append(static_cast<const char*>(data), 8);
  auto it = scalars_.find(id);
  if (it == scalars_.end()) {
    absl::StatusOr<Buffer> b =
        plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
    if (!b.ok()) return b.status();
    it = scalars_.emplace(std::move(id), *std::move(b)).first;
  }
  return it->second.get();
}

absl::StatusOr<PJRT_Buffer*> PjrtChip::OffsetBuffer(int device,
                                                    int64_t offset) {
  Transfer x;
  x.type = &I64();
  x.scalar_i = offset;
  return ScalarBuffer(device, x);
}

}  // namespace tpud::pjrt

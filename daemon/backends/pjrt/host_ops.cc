// Ops computed on the host, or whose results are sized by the data:
// .item(), equal, nonzero / masked_select, index.Tensor with a mask,
// _unique2 / unique_consecutive.
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

namespace {

// A result of a size only the data gave: its first `bytes` of `data` go
// into memory the session's result allocator hands out (charged to its
// quota), and `v` (its dtype and shape) points there.
absl::Status PushAllocated(ResultAllocator* allocator, ResultValue v,
                           const void* data, uint64_t bytes,
                           std::vector<ResultValue>* results) {
  if (bytes > 0) {
    absl::StatusOr<ResultAllocator::Block> block = allocator->Allocate(bytes);
    if (!block.ok()) return block.status();
    std::memcpy(block->host, data, bytes);
    v.tensor.address = block->address;
  }
  results->push_back(v);
  return absl::OkStatus();
}

}  // namespace

// .item(): the one element, read where it lies (a device-to-host copy of
// one element; tensors live in tpud's arena in this version).
absl::Status PjrtChip::ReadScalar(const std::string& op,
                                  const tpu::DecodedOp& decoded,
                                  const std::vector<ResolvedTensor>& tensors,
                                  std::vector<ResultValue>* results) {
  if (decoded.num_args < 1 || decoded.args[0].tag != tpu::ArgTag::kTensor) {
    return Unsupported(op, "expects a tensor");
  }
  const tpu::TensorRef& ref = decoded.args[0].tensor;
  const int64_t numel = Numel(ref);
  if (numel != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": a tensor with ", numel,
                     " elements cannot be converted to a scalar"));
  }
  Lowering l(op, decoded, tensors);
  // Unsigned types are read too, though no op on them is lowered.
  const int element_bytes = tpu::ElementSize(ref.dtype);
  absl::StatusOr<char*> host = element_bytes > 0
                                   ? l.HostOfElements(ref, 0, element_bytes)
                                   : l.HostOf(ref, 0);
  if (!host.ok()) return host.status();
  if (results == nullptr) return absl::OkStatus();
  ResultValue v;
  auto get = [&](auto x) {
    std::memcpy(&x, *host, sizeof(x));
    return x;
  };
  // complex64 and complex128: the real part, then the imaginary one.
  auto complex = [&](auto pair) {
    const auto c = get(pair);
    v.kind = ResultValue::Kind::kComplex;
    v.d = c[0];
    v.d_imag = c[1];
  };
  // Integers that fit int64 come back as ATen's int Scalar.
  auto integer = [&](auto x) {
    v.kind = ResultValue::Kind::kInt;
    v.i = static_cast<int64_t>(get(x));
  };
  using tpu::DType;
  switch (tpu::DTypeFromCode(ref.dtype)) {
    case DType::kUInt8:
      integer(uint8_t{});
      break;
    case DType::kInt8:
      integer(int8_t{});
      break;
    case DType::kInt16:
      integer(int16_t{});
      break;
    case DType::kInt32:
      integer(int32_t{});
      break;
    case DType::kInt64:
      integer(int64_t{});
      break;
    case DType::kUInt16:
      integer(uint16_t{});
      break;
    case DType::kUInt32:
      integer(uint32_t{});
      break;
    case DType::kUInt64: {
      // As ATen's item(): an int up to INT64_MAX, an unsigned one above.
      const uint64_t u = get(uint64_t{});
      v.kind = u > static_cast<uint64_t>(INT64_MAX) ? ResultValue::Kind::kUInt
                                                    : ResultValue::Kind::kInt;
      v.i = static_cast<int64_t>(u);
      break;
    }
    case DType::kFloat:
      v.kind = ResultValue::Kind::kDouble;
      v.d = get(float{});
      break;
    case DType::kDouble:
      v.kind = ResultValue::Kind::kDouble;
      v.d = get(double{});
      break;
    case DType::kBool:
      v.kind = ResultValue::Kind::kBool;
      v.b = get(uint8_t{}) != 0;
      break;
    case DType::kHalf:
      v.kind = ResultValue::Kind::kDouble;
      v.d = tpu::HalfToFloat(get(uint16_t{}));
      break;
    case DType::kBFloat16:
      v.kind = ResultValue::Kind::kDouble;
      v.d = tpu::BFloat16ToFloat(get(uint16_t{}));
      break;
    case DType::kComplexFloat:
      complex(std::array<float, 2>{});
      break;
    case DType::kComplexDouble:
      complex(std::array<double, 2>{});
      break;
    default:
      return Unsupported(
          op, absl::StrCat("reading a scalar of dtype ", int(ref.dtype)));
  }
  results->push_back(v);
  return absl::OkStatus();
}

// The device a tensor at device address `address` lies on.
absl::StatusOr<int> PjrtChip::DeviceOf(const std::string& name,
                                       uint64_t address) const {
  const int device = tpu::DeviceAddressChip(address);
  if (device < 0 || device >= plugin_->num_devices()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": a tensor on chip ", device,
        ", which has no device (this host has ", plugin_->num_devices(), ")"));
  }
  return device;
}

// Runs `program` on `device`, its parameters copied in from `transfers`,
// and copies its results out to `dsts` (one per result: where, and how many
// bytes).
absl::Status PjrtChip::RunToHost(
    const std::string& name, const std::vector<Transfer>& transfers,
    const std::string& program, int device,
    const std::vector<std::pair<void*, size_t>>& dsts) {
  absl::StatusOr<std::shared_ptr<const Executable>> exe =
      Compiled(program, device);
  if (!exe.ok())
    return absl::Status(exe.status().code(),
                        absl::StrCat(name, ": ", exe.status().message()));
  std::vector<Buffer> inputs;
  std::vector<PJRT_Buffer*> args;
  for (const Transfer& x : transfers) {
    const void* data = x.data;
    if (data == nullptr)
      data = x.type->is_float ? static_cast<const void*>(&x.scalar_d)
                              : static_cast<const void*>(&x.scalar_i);
    absl::StatusOr<Buffer> buf =
        plugin_->FromHost(device, data, x.type->pjrt, x.dims, x.byte_strides);
    if (!buf.ok())
      return absl::Status(buf.status().code(),
                          absl::StrCat(name, ": ", buf.status().message()));
    args.push_back(buf->get());
    inputs.push_back(*std::move(buf));
  }
  absl::StatusOr<std::vector<Buffer>> out =
      plugin_->Execute(**exe, device, args);
  if (!out.ok())
    return absl::Status(out.status().code(),
                        absl::StrCat(name, ": ", out.status().message()));
  if (out->size() != dsts.size()) {
    return absl::InternalError(absl::StrCat(name, ": the program gave ",
                                            out->size(), " results for ",
                                            dsts.size()));
  }
  for (size_t o = 0; o < dsts.size(); ++o) {
    if (dsts[o].second == 0) continue;
    if (absl::Status st =
            plugin_->ToHost((*out)[o], dsts[o].first, dsts[o].second);
        !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(name, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

// nonzero(self) and masked_select(self, mask), whose result's length is
// the data's: one program gives the count and, for every element, the flat
// positions of the selected ones first (a stable sort of the positions,
// the others keyed past the end); the first `count` rows are copied into
// memory the result allocator charges to the session.
absl::Status PjrtChip::Selected(const std::string& name,
                                const tpu::DecodedOp& decoded,
                                const std::vector<ResolvedTensor>& tensors,
                                std::vector<ResultValue>* results,
                                ResultAllocator* allocator) {
  const bool select = name == "aten::masked_select";
  const bool index = name == "aten::index.Tensor";
  if (decoded.num_args < (select || index ? 2u : 1u) ||
      decoded.args[0].tag != tpu::ArgTag::kTensor ||
      (select && decoded.args[1].tag != tpu::ArgTag::kTensor)) {
    return Unsupported(name, "expects tensors");
  }
  if (index) return MaskIndex(name, decoded, tensors, results, allocator);
  if (!decoded.outputs.empty() || allocator == nullptr || results == nullptr) {
    return Unsupported(name, "an output given in advance");
  }
  const tpu::TensorRef& x = decoded.args[0].tensor;
  const HloType* xt = DTypeOf(x.dtype);
  if (xt == nullptr) return Unsupported(name, "a dtype that is not lowered");
  // The elements: self's dims, broadcast with the mask's.
  std::vector<int64_t> dims = DimsOf(x);
  if (select) {
    const std::vector<int64_t> md = DimsOf(decoded.args[1].tensor);
    std::vector<int64_t> b(std::max(dims.size(), md.size()), 1);
    for (size_t q = 0; q < b.size(); ++q) {
      const int64_t u =
          q + dims.size() >= b.size() ? dims[q + dims.size() - b.size()] : 1;
      const int64_t v =
          q + md.size() >= b.size() ? md[q + md.size() - b.size()] : 1;
      if (u != v && u != 1 && v != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ": the shapes of self and mask do not broadcast"));
      }
      b[q] = u == 1 ? v : u;
    }
    dims = b;
  }
  int64_t total = 1;
  for (int64_t s : dims) total *= s;
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  const size_t rank = dims.size();
  ResultValue v;
  v.kind = ResultValue::Kind::kTensor;
  v.tensor.dtype = select ? x.dtype : 4;
  v.tensor.ndim = select ? 1 : 2;
  int64_t count = 0;
  std::vector<char> rows;
  const size_t row_bytes = select ? xt->bytes : rank * 8;
  if (total > 0) {
    Lowering l(name, decoded, tensors);
    const std::vector<int64_t> flat = {total};
    absl::StatusOr<std::string> xv = l.Operand(decoded.args[0], dims, *xt);
    if (!xv.ok()) return xv.status();
    std::string mask;
    if (select) {
      absl::StatusOr<std::string> mv = l.Operand(decoded.args[1], dims, i1);
      if (!mv.ok()) return mv.status();
      mask = *mv;
    } else {
      mask = l.Compare("NE", *xv, l.Constant(0, dims, *xt), dims, *xt);
    }
    const std::string mflat = l.Reshape(mask, dims, flat, i1);
    const std::string key =
        l.Select(mflat, l.Iota(0, flat, i64),
                 l.Constant(static_cast<double>(total), flat, i64), flat, i64);
    const std::string n = l.ReduceOver(l.Convert(mflat, flat, i1, i64), flat,
                                       {0}, "add", l.Constant(0, {}, i64), i64);
    std::string out;
    std::string out_type;
    if (select) {
      // Sort (key, value) pairs by key.
      const std::string vs = TypeOf({}, *xt), ks = TypeOf({}, i64),
                        b = TypeOf({}, i1);
      const std::string sorted = l.EmitResults(
          absl::StrCat(
              "\"stablehlo.sort\"(", key, ", ", l.Reshape(*xv, dims, flat, *xt),
              ") ({\n", "    ^bb0(%ka: ", ks, ", %kb: ", ks, ", %va: ", vs,
              ", %vb: ", vs, "):\n",
              "      %lt = stablehlo.compare LT, %ka, %kb, SIGNED : (", ks,
              ", ", ks, ") -> ", b, "\n", "      stablehlo.return %lt : ", b,
              "\n", "    }) {dimension = 0 : i64, is_stable = true} : (",
              TypeOf(flat, i64), ", ", TypeOf(flat, *xt), ") -> (",
              TypeOf(flat, i64), ", ", TypeOf(flat, *xt), ")"),
          2);
      out = sorted + "#1";
      out_type = TypeOf(flat, *xt);
    } else {
      const std::string keys = l.Sort(key, flat, 0, false, i64).first;
      std::vector<std::string> parts;
      int64_t stride = total;
      for (size_t q = 0; q < rank; ++q) {
        stride /= dims[q];
        parts.push_back(l.Binary(
            "remainder",
            l.Binary("divide", keys,
                     l.Constant(static_cast<double>(stride), flat, i64), flat,
                     i64),
            l.Constant(static_cast<double>(dims[q]), flat, i64), flat, i64));
      }
      if (rank == 0) {
        out = l.Constant(0, {total, 0}, i64);
        out_type = TypeOf({total, 0}, i64);
      } else {
        out = StackIndices(l, parts, flat);
        out_type = TypeOf({total, static_cast<int64_t>(rank)}, i64);
      }
    }
    const std::string program = l.Text({n, out}, {TypeOf({}, i64), out_type});
    absl::StatusOr<int> device = DeviceOf(name, x.address);
    if (!device.ok()) return device.status();
    rows.resize(static_cast<size_t>(total) * row_bytes);
    if (absl::Status st = RunToHost(name, l.transfers(), program, *device,
                                    {{&count, 8}, {rows.data(), rows.size()}});
        !st.ok()) {
      return st;
    }
    if (count < 0 || count > total)
      return absl::InternalError(
          absl::StrCat(name, ": the program counted ", count));
  }
  v.tensor.sizes[0] = count;
  if (select) {
    v.tensor.strides[0] = 1;
  } else {
    v.tensor.sizes[1] = static_cast<int64_t>(rank);
    v.tensor.strides[0] = std::max<int64_t>(static_cast<int64_t>(rank), 1);
    v.tensor.strides[1] = 1;
  }
  return PushAllocated(allocator, v, rows.data(),
                       static_cast<uint64_t>(count) * row_bytes, results);
}

// index.Tensor(self, [mask]) with one boolean (or byte) mask over self's
// leading dimensions: the rows the mask selects, in order, as the CPU
// kernel gives them (its other forms take index tensors and are lowered
// with the other rules).
absl::Status PjrtChip::MaskIndex(const std::string& name,
                                 const tpu::DecodedOp& decoded,
                                 const std::vector<ResolvedTensor>& tensors,
                                 std::vector<ResultValue>* results,
                                 ResultAllocator* allocator) {
  const tpu::OpArg& list = decoded.args[1];
  if (list.tag != tpu::ArgTag::kOptionalTensorList ||
      list.tensor_present.empty() || !list.tensor_present[0] ||
      std::count(list.tensor_present.begin(), list.tensor_present.end(),
                 true) != 1 ||
      list.tensors.empty() ||
      (list.tensors[0].dtype != tpu::Code(tpu::DType::kBool) &&
       list.tensors[0].dtype != tpu::Code(tpu::DType::kUInt8))) {
    return Unsupported(
        name, "a data-dependent result other than one leading boolean mask");
  }
  const tpu::TensorRef& x = decoded.args[0].tensor;
  const tpu::TensorRef& mr = list.tensors[0];
  const HloType* xt = DTypeOf(x.dtype);
  if (xt == nullptr) return Unsupported(name, "a dtype that is not lowered");
  const std::vector<int64_t> xd = DimsOf(x), md = DimsOf(mr);
  if (md.size() > xd.size() || !std::equal(md.begin(), md.end(), xd.begin())) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": the mask's shape does not match self's leading dimensions"));
  }
  int64_t rows_n = 1, payload = 1;
  for (int64_t s : md) rows_n *= s;
  for (size_t q = md.size(); q < xd.size(); ++q) payload *= xd[q];
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  ResultValue v;
  v.kind = ResultValue::Kind::kTensor;
  v.tensor.dtype = x.dtype;
  v.tensor.ndim = static_cast<uint8_t>(1 + xd.size() - md.size());
  int64_t count = 0;
  std::vector<char> rows;
  const size_t row_bytes = static_cast<size_t>(payload) * xt->bytes;
  if (rows_n > 0 && payload > 0) {
    Lowering l(name, decoded, tensors);
    const std::vector<int64_t> flat = {rows_n}, table = {rows_n, payload};
    absl::StatusOr<std::string> xv = l.Operand(decoded.args[0], xd, *xt);
    if (!xv.ok()) return xv.status();
    const HloType& mt = *DTypeOf(mr.dtype);
    absl::StatusOr<std::string> mv = l.OperandRef(mr, 1, md, mt);
    if (!mv.ok()) return mv.status();
    const std::string mflat = l.Reshape(
        l.Compare("NE", *mv, l.Constant(0, md, mt), md, mt), md, flat, i1);
    const std::string key =
        l.Select(mflat, l.Iota(0, flat, i64),
                 l.Constant(static_cast<double>(rows_n), flat, i64), flat, i64);
    const std::string n = l.ReduceOver(l.Convert(mflat, flat, i1, i64), flat,
                                       {0}, "add", l.Constant(0, {}, i64), i64);
    const std::string keys = l.Sort(key, flat, 0, false, i64).first;
    const std::string at = l.Reshape(
        l.Binary("minimum", keys,
                 l.Constant(static_cast<double>(rows_n - 1), flat, i64), flat,
                 i64),
        flat, {rows_n, 1}, i64);
    const std::string gathered = l.Emit(absl::StrCat(
        "\"stablehlo.gather\"(", l.Reshape(*xv, xd, table, *xt), ", ", at,
        ") {dimension_numbers = #stablehlo.gather<offset_dims = [1], "
        "collapsed_slice_dims = [0], start_index_map = [0], "
        "index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = "
        "array<i64: 1, ",
        payload, ">} : (", TypeOf(table, *xt), ", ", TypeOf({rows_n, 1}, i64),
        ") -> ", TypeOf(table, *xt)));
    const std::string program =
        l.Text({n, gathered}, {TypeOf({}, i64), TypeOf(table, *xt)});
    absl::StatusOr<int> device = DeviceOf(name, x.address);
    if (!device.ok()) return device.status();
    rows.resize(static_cast<size_t>(rows_n) * row_bytes);
    if (absl::Status st = RunToHost(name, l.transfers(), program, *device,
                                    {{&count, 8}, {rows.data(), rows.size()}});
        !st.ok()) {
      return st;
    }
    if (count < 0 || count > rows_n)
      return absl::InternalError(
          absl::StrCat(name, ": the program counted ", count));
  }
  v.tensor.sizes[0] = count;
  int64_t stride = 1;
  for (size_t q = xd.size(); q-- > md.size();) {
    const size_t o = 1 + q - md.size();
    v.tensor.sizes[o] = xd[q];
    v.tensor.strides[o] = stride;
    stride *= std::max<int64_t>(xd[q], 1);
  }
  v.tensor.strides[0] = stride;
  return PushAllocated(allocator, v, rows.data(),
                       static_cast<uint64_t>(count) * row_bytes, results);
}

// _unique2(self, sorted, return_inverse, return_counts) and
// unique_consecutive(self, return_inverse, return_counts, dim = None) ->
// (values, inverse, counts): the elements sorted (stably, NaN last; in
// place for unique_consecutive), a new group wherever an element differs
// from the one before (each NaN its own), the groups' values, every
// element's group and the groups' sizes, computed for all elements in one
// program; the first `count` values and counts are copied into memory the
// result allocator charges to the session. (Sorted whether asked or not.)
absl::Status PjrtChip::Unique(const std::string& name,
                              const tpu::DecodedOp& decoded,
                              const std::vector<ResolvedTensor>& tensors,
                              std::vector<ResultValue>* results,
                              ResultAllocator* allocator) {
  const bool consecutive = name == "aten::unique_consecutive";
  if (decoded.num_args < (consecutive ? 3u : 4u) ||
      decoded.args[0].tag != tpu::ArgTag::kTensor) {
    return Unsupported(name, "arguments of a form not lowered");
  }
  if (!decoded.outputs.empty() || allocator == nullptr || results == nullptr) {
    return Unsupported(name, "an output given in advance");
  }
  if (consecutive && decoded.num_args > 3 &&
      decoded.args[3].tag != tpu::ArgTag::kNone)
    return Unsupported(name, "dim");
  const bool want_inverse = decoded.args[consecutive ? 1 : 2].b,
             want_counts = decoded.args[consecutive ? 2 : 3].b;
  const tpu::TensorRef& x = decoded.args[0].tensor;
  const HloType* xt = DTypeOf(x.dtype);
  if (xt == nullptr || IsComplex(*xt))
    return Unsupported(name, "a dtype that is not lowered");
  const std::vector<int64_t> xd = DimsOf(x);
  const int64_t total = Numel(x);
  const HloType& i64 = I64();
  const HloType& i1 = *DTypeOf(tpu::DType::kBool);
  int64_t count = 0;
  std::vector<char> values(static_cast<size_t>(total) * xt->bytes);
  std::vector<int64_t> inverse(static_cast<size_t>(total)),
      counts(static_cast<size_t>(total));
  if (total > 0) {
    Lowering l(name, decoded, tensors);
    const std::vector<int64_t> flat = {total};
    absl::StatusOr<std::string> xv = l.Operand(decoded.args[0], xd, *xt);
    if (!xv.ok()) return xv.status();
    std::string sv = l.Reshape(*xv, xd, flat, *xt), perm = l.Iota(0, flat, i64);
    if (!consecutive) std::tie(sv, perm) = l.Sort(sv, flat, 0, false, *xt);
    std::string before = sv;
    if (total > 1) {
      const std::string head = l.SliceAlong(sv, flat, 0, 0, 1, *xt),
                        body = l.SliceAlong(sv, flat, 0, 0, total - 1, *xt);
      before = l.Emit(absl::StrCat("stablehlo.concatenate ", head, ", ", body,
                                   ", dim = 0 : (", TypeOf({1}, *xt), ", ",
                                   TypeOf({total - 1}, *xt), ") -> ",
                                   TypeOf(flat, *xt)));
    }
    const std::string first = l.Compare("EQ", l.Iota(0, flat, i64),
                                        l.Constant(0, flat, i64), flat, i64);
    const std::string is_new =
        l.Binary("or", first, l.Compare("NE", sv, before, flat, *xt), flat, i1);
    const std::string ones = l.Convert(is_new, flat, i1, i64);
    const std::string group =
        l.Binary("subtract", Running(l, ones, flat, 0, "add", 0, i64),
                 l.Constant(1, flat, i64), flat, i64);
    const std::string n =
        l.ReduceOver(ones, flat, {0}, "add", l.Constant(0, {}, i64), i64);
    auto scatter = [&](const std::string& into, const std::string& at,
                       const std::string& what, const HloType& t, bool add) {
      return ScatterFlat(l, into, total, at, what, total, add, t);
    };
    // Each group's value from its first element (a later element of the
    // group is sent nowhere: past the end).
    const std::string dest =
        l.Select(is_new, group,
                 l.Constant(static_cast<double>(total), flat, i64), flat, i64);
    const std::string vals =
        scatter(l.Constant(0, flat, *xt), dest, sv, *xt, false);
    const std::string inv =
        scatter(l.Constant(0, flat, i64), perm, group, i64, false);
    const std::string cnt = scatter(l.Constant(0, flat, i64), group,
                                    l.Constant(1, flat, i64), i64, true);
    const std::string program =
        l.Text({n, vals, inv, cnt}, {TypeOf({}, i64), TypeOf(flat, *xt),
                                     TypeOf(flat, i64), TypeOf(flat, i64)});
    absl::StatusOr<int> device = DeviceOf(name, x.address);
    if (!device.ok()) return device.status();
    if (absl::Status st = RunToHost(name, l.transfers(), program, *device,
                                    {{&count, 8},
                                     {values.data(), values.size()},
                                     {inverse.data(), inverse.size() * 8},
                                     {counts.data(), counts.size() * 8}});
        !st.ok()) {
      return st;
    }
    if (count < 0 || count > total)
      return absl::InternalError(
          absl::StrCat(name, ": the program counted ", count));
  }
  // One result: `dims` of dtype from `data`.
  auto emit = [&](int8_t dtype, const std::vector<int64_t>& dims,
                  const void* data, size_t esize) -> absl::Status {
    ResultValue v;
    v.kind = ResultValue::Kind::kTensor;
    v.tensor.dtype = dtype;
    v.tensor.ndim = static_cast<uint8_t>(dims.size());
    int64_t stride = 1, n = 1;
    for (size_t q = dims.size(); q-- > 0;) {
      v.tensor.sizes[q] = dims[q];
      v.tensor.strides[q] = stride;
      stride *= std::max<int64_t>(dims[q], 1);
      n *= dims[q];
    }
    return PushAllocated(allocator, v, data, static_cast<uint64_t>(n) * esize,
                         results);
  };
  if (absl::Status st = emit(x.dtype, {count}, values.data(), xt->bytes);
      !st.ok())
    return st;
  if (absl::Status st = emit(4, want_inverse ? xd : std::vector<int64_t>{0},
                             inverse.data(), 8);
      !st.ok())
    return st;
  return emit(4, {want_counts ? count : 0}, counts.data(), 8);
}

// equal(self, other) -> bool: the same sizes and every element equal (NaN
// is not), computed on the device and read back as a host value.
absl::Status PjrtChip::Equal(const std::string& name,
                             const tpu::DecodedOp& decoded,
                             const std::vector<ResolvedTensor>& tensors,
                             std::vector<ResultValue>* results) {
  if (decoded.num_args < 2 || decoded.args[0].tag != tpu::ArgTag::kTensor ||
      decoded.args[1].tag != tpu::ArgTag::kTensor) {
    return Unsupported(name, "expects two tensors");
  }
  const tpu::TensorRef &a = decoded.args[0].tensor, &b = decoded.args[1].tensor;
  ResultValue v;
  v.kind = ResultValue::Kind::kBool;
  v.b = DimsOf(a) == DimsOf(b);
  if (v.b && Numel(a) > 0) {
    const HloType* ta = DTypeOf(a.dtype);
    const HloType* tb = DTypeOf(b.dtype);
    if (ta == nullptr || tb == nullptr)
      return Unsupported(name, "a dtype that is not lowered");
    // Compared in the wider kind: float64 if either is a float, else int64.
    const HloType& t = ta->is_float || tb->is_float ? F64() : I64();
    const std::vector<int64_t> dims = DimsOf(a);
    Lowering l(name, decoded, tensors);
    absl::StatusOr<std::string> x = l.Operand(decoded.args[0], dims, t),
                                y = l.Operand(decoded.args[1], dims, t);
    if (!x.ok()) return x.status();
    if (!y.ok()) return y.status();
    const HloType& i1 = *DTypeOf(tpu::DType::kBool);
    const std::string eq = l.Compare("EQ", *x, *y, dims, t);
    const std::string all = l.ReduceOver(eq, dims, Range(dims.size()), "and",
                                         l.Constant(1, {}, i1), i1);
    const std::string program = l.Text({all}, {TypeOf({}, i1)});
    absl::StatusOr<int> device = DeviceOf(name, a.address);
    if (!device.ok()) return device.status();
    uint8_t byte = 0;
    if (absl::Status st =
            RunToHost(name, l.transfers(), program, *device, {{&byte, 1}});
        !st.ok())
      return st;
    v.b = byte != 0;
  }
  if (results != nullptr) results->push_back(v);
  return absl::OkStatus();
}

void RegisterHostOps(OpRegistry& reg) {
  reg.AddHost("aten::_local_scalar_dense", HostKind::kLocalScalar);
  reg.AddHost("aten::equal", HostKind::kEqual);
  reg.AddHost("aten::nonzero", HostKind::kSelect);
  reg.AddHost("aten::masked_select", HostKind::kSelect);
  reg.AddHost("aten::_unique2", HostKind::kUnique);
  reg.AddHost("aten::unique_consecutive", HostKind::kUnique);
}

}  // namespace tpud::pjrt

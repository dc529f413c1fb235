// Building blocks the op families share: rule makers (BinaryRule,
// UnaryRule, Simple), argument readers, reductions, windows and index
// arrays.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_LOWERING_HELPERS_H_
#define TPUD_DAEMON_BACKENDS_PJRT_LOWERING_HELPERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/backends/pjrt/lowering/lowering.h"

namespace tpud::pjrt {

// An op's arguments by their schema names: Args a(l); a.Tensor("other"),
// a.Int("dim", 0), a.Number("alpha", 1). An argument the schema does not
// name, or the record does not carry (a trailing default), is absent.
class Args {
 public:
  explicit Args(const Lowering& l) : d_(l.decoded()), names_(l.arg_names()) {}
  // The argument, or null where absent.
  const tpu::OpArg* Find(absl::string_view name) const;
  bool Has(absl::string_view name) const { return Find(name) != nullptr; }
  // Present and a (defined) tensor.
  bool Defined(absl::string_view name) const;
  // REQUIRES: Has(name).
  const tpu::OpArg& operator[](absl::string_view name) const {
    return *Find(name);
  }
  // An int argument's value, or `absent`.
  int64_t Int(absl::string_view name, int64_t absent) const;
  // A number (int, bool or floating scalar) as a double, or `absent`.
  double Number(absl::string_view name, double absent) const;
  // A bool argument's value, or `absent` where it is missing or not a bool.
  bool Flag(absl::string_view name, bool absent) const;

 private:
  const tpu::DecodedOp& d_;
  const std::vector<std::string>* names_;
};

// +inf (floats) or the highest value, as a 0-d constant.
std::string Highest(Lowering& l, const HloType& t);

// op(self, other), other scaled by alpha first where has_alpha (and the
// schema has one); `other` names the second operand ("exponent" for pow).
Rule BinaryRule(const char* op, bool has_alpha, const char* other = "other");

// f(self), self a tensor.
Rule UnaryRule(
    std::function<std::string(Lowering&, const std::string&, const Target&)> f);

Rule Simple(const char* op);

// |v| (dims `dims`, type c) as RealOf(c): a complex v's modulus.
std::string Modulus(Lowering& l, const std::string& v,
                    const std::vector<int64_t>& dims, const HloType& c);

// The real type of t's values: t itself, or a complex type's part type.
const HloType& RealOf(const HloType& t);

// The real and imaginary parts of complex v (dims `dims`), as t's part type.
std::string RealPart(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& dims, const HloType& t);
std::string ImagPart(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& dims, const HloType& t);

// The conjugate of v (a real v is its own).
std::string Conj(Lowering& l, const std::string& v,
                 const std::vector<int64_t>& dims, const HloType& t);

// |v|^2 elementwise, as RealOf(t).
std::string SquaredModulus(Lowering& l, const std::string& v,
                           const std::vector<int64_t>& dims, const HloType& t);

// LAPACK's cabs1, |re| + |im| (|v| of a real v), as RealOf(t): what
// pivoting compares.
std::string Cabs1(Lowering& l, const std::string& v,
                  const std::vector<int64_t>& dims, const HloType& t);

// A real v (dims `dims`, type RealOf(t)) as type t.
std::string FromReal(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& dims, const HloType& t);

// |a| (a tensor argument) as type t, dims `dims`: a complex tensor's
// modulus, never its real part's.
absl::StatusOr<std::string> AbsOperand(Lowering& l, const tpu::OpArg& a,
                                       const std::vector<int64_t>& dims,
                                       const HloType& t);

absl::StatusOr<std::string> MatMul(Lowering& l, const tpu::OpArg& a,
                                   const tpu::OpArg& b, const Target& out);

// sum / mean of `self` over the int list `dim` (all when null, empty or not
// a list), keepdim or not, into out's shape.
absl::StatusOr<std::string> Reduce(Lowering& l, const tpu::OpArg& self,
                                   const tpu::OpArg* dim, const Target& out,
                                   bool mean);

int64_t WrapDim(int64_t dim, size_t n);

// Dimension argument `dim` of a tensor of `rank` dimensions, wrapped
// (-1 is the last) and checked.
absl::StatusOr<int64_t> CheckedDim(const std::string& op, int64_t dim,
                                   size_t rank);

int64_t Numel(const tpu::TensorRef& r);

std::vector<int64_t> DimsOf(const tpu::TensorRef& r);

// Whether r is contiguous in row-major order, as Tensor::is_contiguous()
// (dimensions of size 1 may have any stride; an empty tensor is).
bool RowMajor(const tpu::TensorRef& r);

double NumberOf(const tpu::OpArg& a);

// The dimensions an op reduces over: the int list or int `dim` (every
// dimension when null, an empty list or neither), wrapped, sorted and unique.
absl::StatusOr<std::vector<int64_t>> ReducedDims(const Lowering& l,
                                                 const tpu::OpArg* dim,
                                                 size_t rank);

int64_t CountOf(const std::vector<int64_t>& in,
                const std::vector<int64_t>& which);

// A convolution's window: its spatial dimensions and, from the arguments
// named stride, padding, dilation, transposed, output_padding and groups (as
// convolution and convolution_backward name them), one stride, padding and
// dilation per spatial dimension. `in` is the input's dims, `wd` the
// weight's and `other` the third tensor's (the output or the gradient).
struct ConvWindow {
  size_t sp = 0;
  std::vector<int64_t> stride, pad, dilation, output_padding;
  int64_t groups = 1;
  bool transposed = false;
};

absl::StatusOr<ConvWindow> ConvWindowOf(const Lowering& l, const Args& a,
                                        const std::vector<int64_t>& in,
                                        const std::vector<int64_t>& wd,
                                        const std::vector<int64_t>& other,
                                        bool allow_transposed = false);

// log_softmax / softmax over `dim` of x (dims `in`, type t).
std::string SoftmaxOf(Lowering& l, const std::string& x,
                      const std::vector<int64_t>& in, int64_t dim,
                      const HloType& t, bool log);

// erf(x) for gelu: Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7).
std::string Erf(Lowering& l, const std::string& x,
                const std::vector<int64_t>& d, const HloType& t);

std::string GeluCdf(Lowering& l, const std::string& x,
                    const std::vector<int64_t>& d, const HloType& t);

// gelu's approximate= argument (at i): false for "none", true for "tanh".
absl::StatusOr<bool> TanhGelu(const Lowering& l, const tpu::OpArg* approximate);

// tanh(sqrt(2 / pi) * (x + 0.044715 x^3)), of the tanh approximation.
std::string GeluTanhInner(Lowering& l, const std::string& x,
                          const std::vector<int64_t>& d, const HloType& t);

// The element of each row its target picks, as a mask (one-hot, and the
// target not ignore_index), weighted: x (N, C), target (N). `weight` (the
// class weights) counts where it is a tensor; `ignore_index` is -100 where
// null.
struct Picked {
  std::string
      mask;  // (N, C) of t: the picked entries, times their class weight
  std::string
      row_weight;  // (N) of t: the weight of each row's target, 0 when ignored
};

absl::StatusOr<Picked> PickTargets(Lowering& l, const tpu::OpArg& target,
                                   const tpu::OpArg* weight,
                                   const tpu::OpArg* ignore_index,
                                   const std::vector<int64_t>& nc,
                                   const HloType& t);

// The p-norm of `diff` (|a - b|, dims `full`) over dimension `axis`:
// the count of nonzero entries for p = 0, the largest for infinity.
std::string PNorm(Lowering& l, const std::string& diff,
                  const std::vector<int64_t>& full, int64_t axis, double p,
                  const HloType& t);

// 1-d: `into` (n elements) with `what` (m elements) written, or added, at
// the positions `at` (i64, m).
std::string ScatterFlat(Lowering& l, const std::string& into, int64_t n,
                        const std::string& at, const std::string& what,
                        int64_t m, bool add, const HloType& t);

// Whether input i of n falls in adaptive window o of out (dims `dims`,
// o along `out_axis`, i along `in_axis`): [floor(o n / out),
// ceil((o + 1) n / out)).
std::string AdaptiveWindow(Lowering& l, const std::vector<int64_t>& dims,
                           int64_t out_axis, int64_t in_axis, int64_t n,
                           int64_t out);

// A running reduction along `dim` (cumsum, cumprod): a reduce_window whose
// window reaches back over the whole dimension.
std::string Running(Lowering& l, const std::string& x,
                    const std::vector<int64_t>& in, int64_t dim, const char* op,
                    double init, const HloType& t,
                    const std::string& init_value = "");

// `x` (dims `in`) reduced with `op` over windows of `window`, `strides`
// apart, after padding each dimension by (lo, hi) with `init`: dims `out`.
std::string ReduceWindow(Lowering& l, const std::string& x,
                         const std::vector<int64_t>& in,
                         const std::vector<int64_t>& window,
                         const std::vector<int64_t>& strides,
                         const std::vector<std::pair<int64_t, int64_t>>& pads,
                         const char* op, double init,
                         const std::vector<int64_t>& out, const HloType& t);

// Index arrays (each i64 of dims `shape`) stacked along a new last
// dimension, the layout gather and scatter take: shape + [parts.size()].
std::string StackIndices(Lowering& l, const std::vector<std::string>& parts,
                         const std::vector<int64_t>& shape);

// For torch.gather / scatter: the full index of every element of an index
// tensor of dims `shape` into a tensor of the same rank, its position on
// each dimension but `dim`, where `along` (i64, dims `shape`) gives it.
std::string ElementIndex(Lowering& l, const std::string& along,
                         const std::vector<int64_t>& shape, int64_t dim);

// 0, 1, ..., n - 1.
std::vector<int64_t> Range(size_t n);

// Advanced indexing by integer index tensors (an optional tensor list, one
// entry per leading dimension of self, `in`): the index tensors broadcast
// together to `batch`, negative indices counted from the end, stacked into
// one index array for gather / scatter. The result is self's dimensions with
// the indexed ones replaced by `batch` (in place when they are adjacent, else
// first: NumPy's rule). Bool and byte masks give data-dependent shapes and
// are not lowered.
struct IndexPlan {
  std::vector<int64_t> indexed;  // self's indexed dimensions, in order
  std::vector<int64_t> batch;    // the index tensors' broadcast shape
  std::string indices;           // batch + [indexed.size()] of i64
  std::string indices_type;
  std::vector<int64_t> window;  // the result's positions of self's other dims
  std::vector<int64_t> slice;   // gather's slice sizes (1 on indexed dims)
  std::vector<int64_t> result;
};

absl::StatusOr<IndexPlan> PlanIndex(Lowering& l, const tpu::OpArg& list,
                                    const std::vector<int64_t>& in);

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_LOWERING_HELPERS_H_

// Sparse COO tensors on "tpu". A sparse tpu tensor is ATen's SparseTensorImpl
// (dispatch key SparsePrivateUse1) whose indices and values are dense tpu
// tensors in daemon HBM, so every sparse op here is a short sequence of dense
// ops that run in tpud like any other.
//
// Two kinds of kernels:
//  - ATen's own sparse kernels that are written in terms of dense ops on
//    indices and values and serve SparseCPU and SparseCUDA alike (the same
//    kernel for both in native_functions.yaml). They run unchanged: the tpu
//    registration redispatches to that shared kernel. kSharedSparseKernels
//    lists them; tests/python/test_sparse.py checks the list against the
//    installed torch.
//  - The ops whose CPU and CUDA kernels are device specific (coalesce, add
//    and mul into an output, addmm, sparse x sparse matmul, sparse_mask and
//    its projection, the backward of sparse sum, index_select, softmax and
//    log_softmax with their backwards), written below from dense
//    tpu ops. sparse_mask's shared kernel handles a dense self through mul
//    but a sparse one through a CPU/CUDA-only stub, hence its own here.
// Anything else on a sparse COO tpu tensor fails with an error that names
// the op; every other sparse layout, one that names the layout.
#include "sparse.h"

#include <ATen/ATen.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_to_sparse_native.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

namespace torch_tpu {
namespace {

const char* const kSharedSparseKernels[] = {
    "abs",
    "abs_",
    "abs.out",
    "view_as_real",
    "view_as_complex",
    "sgn",
    "sgn_",
    "sgn.out",
    "conj_physical.out",
    "add.Tensor",
    "add_.Tensor",
    "asinh",
    "asinh_",
    "asinh.out",
    "atanh",
    "atanh_",
    "atanh.out",
    "asin",
    "asin_",
    "asin.out",
    "atan",
    "atan_",
    "atan.out",
    "_sparse_broadcast_to",
    "cat",
    "ceil",
    "ceil_",
    "ceil.out",
    "copy_",
    "div.Tensor",
    "div_.Tensor",
    "div.out",
    "div.Tensor_mode",
    "div_.Tensor_mode",
    "div.out_mode",
    "empty.memory_format",
    "empty_like",
    "erf",
    "erf_",
    "erf.out",
    "expm1",
    "expm1_",
    "expm1.out",
    "floor",
    "floor_",
    "floor.out",
    "floor_divide",
    "floor_divide_.Tensor",
    "floor_divide.out",
    "frac",
    "frac_",
    "frac.out",
    "isnan",
    "nan_to_num",
    "nan_to_num_",
    "nan_to_num.out",
    "log1p",
    "log1p_",
    "log1p.out",
    "mm",
    "mm.out",
    "mul.Tensor",
    "mul_.Tensor",
    "mv",
    "narrow_copy",
    "permute",
    "rad2deg",
    "rad2deg_",
    "rad2deg.out",
    "deg2rad",
    "deg2rad_",
    "deg2rad.out",
    "neg",
    "neg_",
    "neg.out",
    "round",
    "round_",
    "round.out",
    "relu",
    "relu_",
    "sin",
    "sin_",
    "sin.out",
    "sinh",
    "sinh_",
    "sinh.out",
    "sum",
    "sum.dim_IntList",
    "sqrt",
    "sqrt_",
    "sqrt.out",
    "tan",
    "tan_",
    "tan.out",
    "tanh",
    "tanh_",
    "tanh.out",
    "threshold_backward.grad_input",
    "threshold_backward",
    "trunc",
    "trunc_",
    "trunc.out",
    "unsqueeze",
    "zeros.out",
    "native_norm",
    "native_norm.ScalarOpt_dim_dtype",
    "norm.ScalarOpt_dim_dtype",
    "norm.ScalarOpt_dim",
    "clone",
    "resize_as_sparse_",
    "zero_",
    "sub.out",
    "sub.Tensor",
    "sub_.Tensor",
    "_sparse_coo_tensor_with_dims",
    "_sparse_coo_tensor_with_dims_and_tensors",
    "sparse_resize_",
    "sparse_resize_and_clear_",
    "_to_dense",
    "sparse_dim",
    "_dimI",
    "dense_dim",
    "_dimV",
    "_nnz",
    "is_coalesced",
    "_indices",
    "_values",
    "_coalesced_",
    "indices",
    "values",
    "copy_sparse_to_sparse_",
    "_to_sparse.sparse_dim",
    "_to_sparse",
    "erfinv",
    "erfinv_",
    "erfinv.out",
    "sign",
    "sign_",
    "sign.out",
    "signbit",
    "signbit.out",
    "any",
    "pow.Tensor_Scalar_out",
    "pow.Tensor_Scalar",
    "isinf",
    "isposinf",
    "isposinf.out",
    "isneginf",
    "isneginf.out",
};

// The kernel ATen registers for both SparseCPU and SparseCUDA composes dense
// ops on the operands' indices and values, which dispatch on their own
// (tpu) keys; running it for tpu operands is what CUDA does too.
void SharedSparseKernel(const c10::OperatorHandle& op,
                        torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::SparseCPU), stack);
}

at::SparseTensorImpl* Impl(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.is_sparse());
  return static_cast<at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
}

// Puts `indices` and `values` into `out`, a sparse tensor of `sizes`.
at::Tensor& Assign(at::Tensor& out, at::IntArrayRef sizes, int64_t sparse_dim,
                   const at::Tensor& indices, const at::Tensor& values,
                   bool coalesced) {
  at::SparseTensorImpl* impl = Impl(out);
  impl->resize_(sparse_dim, values.dim() - 1, sizes);
  impl->set_indices_and_values_unsafe(indices, values);
  impl->set_coalesced(coalesced);
  return out;
}

at::Tensor MakeSparse(at::IntArrayRef sizes, int64_t sparse_dim,
                      const at::Tensor& indices, const at::Tensor& values,
                      bool coalesced) {
  return at::_sparse_coo_tensor_with_dims_and_tensors(
      sparse_dim, values.dim() - 1, sizes, indices, values,
      values.options().layout(at::kSparse), coalesced);
}

// Row-major position of each stored entry within the sparse dimensions.
at::Tensor Linearize(const at::Tensor& indices, at::IntArrayRef sparse_sizes) {
  std::vector<int64_t> strides(sparse_sizes.size());
  int64_t stride = 1;
  for (int64_t d = static_cast<int64_t>(sparse_sizes.size()) - 1; d >= 0; --d) {
    strides[d] = stride;
    TORCH_CHECK(!c10::mul_overflows(
                    stride, std::max<int64_t>(sparse_sizes[d], 1), &stride),
                "tpu: sparse COO tensor of size ", sparse_sizes,
                ": the number of positions in its sparse dims exceeds int64");
  }
  at::Tensor s =
      at::tensor(strides, at::kLong).to(indices.device()).unsqueeze(1);
  return indices.mul(s).sum(0);
}

at::Tensor Delinearize(const at::Tensor& linear, at::IntArrayRef sparse_sizes) {
  std::vector<at::Tensor> rows(sparse_sizes.size());
  at::Tensor rest = linear;
  for (int64_t d = static_cast<int64_t>(sparse_sizes.size()) - 1; d >= 0; --d) {
    // An entry in a dim of size 0 is an invalid tensor (index >= size).
    TORCH_CHECK(sparse_sizes[d] > 0, "tpu: sparse COO tensor of size ",
                sparse_sizes, " stores entries in a dimension of size 0");
    rows[d] = rest.remainder(sparse_sizes[d]);
    rest = rest.div(sparse_sizes[d], "floor");
  }
  if (rows.empty()) return at::empty({0, linear.size(0)}, linear.options());
  return at::stack(rows);
}

// Sorts entries by position and sums duplicates, as the CPU kernel does.
at::Tensor Coalesce(const at::Tensor& self) {
  const int64_t sparse_dim = self.sparse_dim();
  const at::Tensor indices = self._indices();
  const at::Tensor values = self._values();
  if (self._nnz() < 2) {
    return MakeSparse(self.sizes(), sparse_dim, indices.clone(), values.clone(),
                      true);
  }
  at::IntArrayRef sparse_sizes = self.sizes().slice(0, sparse_dim);
  auto [unique, inverse, counts] =
      at::_unique2(Linearize(indices, sparse_sizes), /*sorted=*/true,
                   /*return_inverse=*/true,
                   /*return_counts=*/false);
  std::vector<int64_t> value_shape = values.sizes().vec();
  value_shape[0] = unique.size(0);
  at::Tensor summed =
      at::zeros(value_shape, values.options()).index_add_(0, inverse, values);
  return MakeSparse(self.sizes(), sparse_dim, Delinearize(unique, sparse_sizes),
                    summed, true);
}

c10::List<std::optional<at::Tensor>> IndexList(const at::Tensor& sparse) {
  c10::List<std::optional<at::Tensor>> list;
  const at::Tensor indices = sparse._indices();
  for (int64_t d = 0; d < sparse.sparse_dim(); ++d)
    list.push_back(indices.select(0, d));
  return list;
}

at::Tensor Scaled(const at::Tensor& t, const at::Scalar& alpha) {
  if (alpha.isIntegral(true) && alpha.toLong() == 1) return t;
  if (alpha.isFloatingPoint() && alpha.toDouble() == 1.0) return t;
  return t.mul(alpha);
}

void CheckSameSizes(const char* op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes(), op,
              ": expected 'self' and 'other' to have the same size, ",
              "but self has size ", a.sizes(), " while other has size ",
              b.sizes());
}

at::Tensor& AddOut(const at::Tensor& self, const at::Tensor& other,
                   const at::Scalar& alpha, at::Tensor& out) {
  TORCH_CHECK(
      !(self.is_sparse() && !other.is_sparse()),
      "add(sparse, dense) is not supported. Use add(dense, sparse) instead.");
  const at::ScalarType common = at::result_type(self, other);
  TORCH_CHECK(at::canCast(common, out.scalar_type()), "result type ", common,
              " can't be cast to the desired output type ", out.scalar_type());
  CheckSameSizes("add", self, other);
  at::Tensor addend =
      Scaled(other._values().to(common), alpha).to(out.scalar_type());
  if (!self.is_sparse()) {
    // dense + sparse: a scatter-add of the stored entries into a dense copy.
    TORCH_CHECK(!out.is_sparse(),
                "add(dense, sparse): the output must be dense");
    if (!out.is_same(self)) {
      out.resize_(self.sizes());
      out.copy_(self);
    }
    if (other._nnz() > 0)
      out.index_put_(IndexList(other), addend, /*accumulate=*/true);
    return out;
  }
  TORCH_CHECK(out.is_sparse(),
              "add(sparse, sparse): the output must be sparse");
  TORCH_CHECK(self.sparse_dim() == other.sparse_dim() &&
                  self.dense_dim() == other.dense_dim(),
              "add(sparse, sparse): expected the same sparse and dense "
              "dimensions, but got (",
              self.sparse_dim(), ", ", self.dense_dim(), ") and (",
              other.sparse_dim(), ", ", other.dense_dim(), ")");
  // Concatenating the entries is the sum; coalesced operands give a
  // coalesced result, as on the CPU.
  const bool coalesce = self.is_coalesced() && other.is_coalesced();
  at::Tensor indices = at::cat({self._indices(), other._indices()}, 1);
  at::Tensor values =
      at::cat({self._values().to(out.scalar_type()), addend}, 0);
  const std::vector<int64_t> sizes = self.sizes().vec();
  const int64_t sparse_dim = self.sparse_dim();
  if (coalesce) {
    at::Tensor c =
        Coalesce(MakeSparse(sizes, sparse_dim, indices, values, false));
    return Assign(out, sizes, sparse_dim, c._indices(), c._values(), true);
  }
  return Assign(out, sizes, sparse_dim, indices, values, false);
}

// Positions of `query` in `sorted` (both linearized, `sorted` ascending and
// unique): for each query, where it sits in `sorted`, and whether it is there.
std::pair<at::Tensor, at::Tensor> Lookup(const at::Tensor& sorted,
                                         const at::Tensor& query) {
  at::Tensor pos = at::searchsorted(sorted, query)
                       .clamp_max_(std::max<int64_t>(sorted.size(0) - 1, 0));
  at::Tensor found = sorted.index_select(0, pos).eq(query);
  return {pos, found};
}

// Pairs from runs: item i pairs with counts[i] partners (`total` in all).
// For every pair, the item it belongs to and its rank within that item's run.
std::pair<at::Tensor, at::Tensor> EnumeratePairs(const at::Tensor& counts,
                                                 int64_t total) {
  at::Tensor which =
      at::repeat_interleave(counts, std::optional<int64_t>(total));
  at::Tensor first = counts.cumsum(0).sub_(counts);
  at::Tensor rank =
      at::arange(total, counts.options()).sub_(first.index_select(0, which));
  return {which, rank};
}

void CheckMatmulOperands(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.size(1) == b.size(0),
              "mat1 and mat2 shapes cannot be multiplied (", a.size(0), "x",
              a.size(1), " and ", b.size(0), "x", b.size(1), ")");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(),
              "expected mat1 and mat2 to have the same dtype, but got: ",
              a.scalar_type(), " != ", b.scalar_type());
}

at::Tensor& MulOut(const at::Tensor& self, const at::Tensor& other,
                   at::Tensor& out) {
  TORCH_CHECK(out.is_sparse(),
              "mul with a sparse operand: the output must be sparse");
  const at::ScalarType common = at::result_type(self, other);
  TORCH_CHECK(at::canCast(common, out.scalar_type()), "result type ", common,
              " can't be cast to the desired output type ", out.scalar_type());
  if (self.is_sparse() && other.is_sparse()) {
    // The product is nonzero only where both store an entry: match sorted
    // positions with a binary search.
    CheckSameSizes("mul", self, other);
    const at::Tensor a = Coalesce(self);
    const at::Tensor b = Coalesce(other);
    const int64_t sparse_dim = self.sparse_dim();
    const std::vector<int64_t> sizes = self.sizes().vec();
    at::IntArrayRef sparse_sizes = self.sizes().slice(0, sparse_dim);
    if (a._nnz() == 0 || b._nnz() == 0) {
      std::vector<int64_t> value_shape = a._values().sizes().vec();
      value_shape[0] = 0;
      return Assign(out, sizes, sparse_dim, a._indices().narrow(1, 0, 0),
                    at::empty(value_shape,
                              a._values().options().dtype(out.scalar_type())),
                    true);
    }
    const at::Tensor la = Linearize(a._indices(), sparse_sizes);
    const at::Tensor lb = Linearize(b._indices(), sparse_sizes);
    auto [pos, found] = Lookup(lb, la);
    const at::Tensor hit = found.nonzero().squeeze(1);
    at::Tensor values = a._values().index_select(0, hit).to(common).mul(
        b._values().index_select(0, pos.index_select(0, hit)));
    // The result is sorted and unique either way; the flag follows the CPU
    // kernel, which marks it coalesced only for coalesced operands.
    return Assign(out, sizes, sparse_dim, a._indices().index_select(1, hit),
                  values.to(out.scalar_type()),
                  self.is_coalesced() && other.is_coalesced());
  }
  const at::Tensor& sparse = self.is_sparse() ? self : other;
  const at::Tensor& dense = self.is_sparse() ? other : self;
  at::Tensor factor;
  if (dense.dim() == 0) {
    factor = dense;  // a scalar: scales every stored value
  } else {
    TORCH_CHECK(at::is_expandable_to(dense.sizes(), sparse.sizes()),
                "mul(sparse, dense): the dense operand of size ", dense.sizes(),
                " must broadcast to the sparse operand's size ",
                sparse.sizes());
    // The dense operand's entries at the stored positions.
    factor = at::index(dense.expand(sparse.sizes()), IndexList(sparse));
  }
  at::Tensor values =
      sparse._values().to(common).mul(factor).to(out.scalar_type());
  const std::vector<int64_t> sizes = sparse.sizes().vec();
  at::Tensor indices =
      out.is_same(sparse) ? sparse._indices() : sparse._indices().clone();
  return Assign(out, sizes, sparse.sparse_dim(), indices, values,
                sparse.is_coalesced());
}

// sparse (m x k, COO over both dims) @ dense (k x n): gather the rows of
// `dense` that the entries' columns name, scale, and scatter-add by row.
at::Tensor SparseDenseMm(const at::Tensor& sparse, const at::Tensor& dense) {
  TORCH_CHECK(sparse.dim() == 2 && sparse.sparse_dim() == 2 &&
                  dense.dim() == 2 && !dense.is_sparse(),
              "tpu: sparse matmul takes a 2-D sparse COO tensor with two "
              "sparse dims and a "
              "2-D dense tensor, got sizes ",
              sparse.sizes(), " and ", dense.sizes());
  CheckMatmulOperands(sparse, dense);
  const at::Tensor indices = sparse._indices();
  at::Tensor product =
      sparse._values().unsqueeze(1).mul(dense.index_select(0, indices[1]));
  return at::zeros({sparse.size(0), dense.size(1)}, dense.options())
      .index_add_(0, indices[0], product);
}

at::Tensor& AddmmOut(const at::Tensor& self, const at::Tensor& mat1,
                     const at::Tensor& mat2, const at::Scalar& beta,
                     const at::Scalar& alpha, at::Tensor& out) {
  TORCH_CHECK(mat1.is_sparse() && !mat2.is_sparse() && !self.is_sparse() &&
                  !out.is_sparse(),
              "tpu: addmm with sparse operands takes a sparse COO mat1 and "
              "dense self and mat2");
  at::Tensor result = Scaled(SparseDenseMm(mat1, mat2), alpha);
  const bool beta_zero =
      beta.isComplex() ? beta.toComplexDouble() == 0.0 : beta.toDouble() == 0.0;
  if (!beta_zero) {
    result = result.add(self.expand({mat1.size(0), mat2.size(1)}), beta);
  }
  if (!out.is_same(result)) {
    out.resize_(result.sizes());
    out.copy_(result);
  }
  return out;
}

at::Tensor Addmm(const at::Tensor& self, const at::Tensor& mat1,
                 const at::Tensor& mat2, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  at::Tensor out = at::empty({0}, mat2.options());
  return AddmmOut(self, mat1, mat2, beta, alpha, out);
}

at::Tensor& Addmm_(at::Tensor& self, const at::Tensor& mat1,
                   const at::Tensor& mat2, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  return AddmmOut(self, mat1, mat2, beta, alpha, self);
}

// sparse (m x k) @ sparse (k x n): each entry (i, c) of a meets every entry
// (c, j) of b. b coalesced is sorted by row, so the entries of row c are a
// contiguous run; the pairs are enumerated run by run and summed by
// coalescing.
at::Tensor SparseSparseMatmul(const at::Tensor& a_in, const at::Tensor& b_in) {
  TORCH_CHECK(
      a_in.dim() == 2 && b_in.dim() == 2 && a_in.sparse_dim() == 2 &&
          b_in.sparse_dim() == 2,
      "tpu: sparse x sparse matmul takes 2-D sparse COO tensors, got sizes ",
      a_in.sizes(), " and ", b_in.sizes());
  CheckMatmulOperands(a_in, b_in);
  const std::vector<int64_t> sizes = {a_in.size(0), b_in.size(1)};
  const at::Tensor a = Coalesce(a_in);
  const at::Tensor b = Coalesce(b_in);
  const at::Tensor ai = a._indices(), bi = b._indices();
  at::Tensor run_length = at::bincount(bi[0], {}, a_in.size(1));
  at::Tensor run_start = run_length.cumsum(0).sub_(run_length);
  at::Tensor pairs_per_a = run_length.index_select(0, ai[1]);
  const int64_t total = a._nnz() == 0 ? 0 : pairs_per_a.sum().item<int64_t>();
  if (total == 0) {
    return MakeSparse(sizes, 2, at::empty({2, 0}, ai.options()),
                      at::empty({0}, a._values().options()), true);
  }
  auto [which_a, offset] = EnumeratePairs(pairs_per_a, total);
  at::Tensor which_b =
      run_start.index_select(0, ai[1].index_select(0, which_a)).add_(offset);
  at::Tensor indices = at::stack(
      {ai[0].index_select(0, which_a), bi[1].index_select(0, which_b)});
  at::Tensor values = a._values()
                          .index_select(0, which_a)
                          .mul(b._values().index_select(0, which_b));
  return Coalesce(MakeSparse(sizes, 2, indices, values, false));
}

// self's values at the positions of mask's entries (zero where self stores
// none), on mask's pattern.
at::Tensor SparseMask(const at::Tensor& self, const at::Tensor& mask) {
  TORCH_CHECK(mask.is_sparse(),
              "sparse_mask: the mask must be a sparse COO tensor");
  TORCH_CHECK(mask.sizes().equals(self.sizes()),
              "sparse_mask(): operands have incompatible ",
              "sizes; self has size ", self.sizes(), " but mask has size ",
              mask.sizes());
  const int64_t sparse_dim = mask.sparse_dim();
  std::vector<int64_t> value_shape = mask._values().sizes().vec();
  at::Tensor values;
  if (!self.is_sparse()) {
    values = at::index(self, IndexList(mask));
  } else {
    TORCH_CHECK(self.sparse_dim() == sparse_dim,
                "sparse_mask: expected self and mask to have ",
                "the same sparse dims, got ", self.sparse_dim(), " and ",
                sparse_dim);
    values = at::zeros(value_shape, self._values().options());
    if (mask._nnz() > 0 && self._nnz() > 0) {
      const at::Tensor s = Coalesce(self);
      at::IntArrayRef sparse_sizes = self.sizes().slice(0, sparse_dim);
      auto [pos, found] = Lookup(Linearize(s._indices(), sparse_sizes),
                                 Linearize(mask._indices(), sparse_sizes));
      const at::Tensor hit = found.nonzero().squeeze(1);
      values.index_copy_(0, hit,
                         s._values().index_select(0, pos.index_select(0, hit)));
    }
  }
  return MakeSparse(mask.sizes(), sparse_dim, mask._indices().clone(), values,
                    mask.is_coalesced());
}

// self's entries where mask stores an entry at the same position, zero
// elsewhere, on self's pattern; with accumulate_matches each is counted once
// per matching entry of mask (as the CPU kernel does).
at::Tensor SparseMaskProjection(const at::Tensor& self, const at::Tensor& mask,
                                bool accumulate_matches) {
  TORCH_CHECK(
      self.is_sparse() && mask.is_sparse(),
      "_sparse_mask_projection(): both operands must be sparse COO tensors");
  TORCH_CHECK(mask.sizes().equals(self.sizes()),
              "_sparse_mask_projection(): operands have ",
              "incompatible sizes; self has size ", self.sizes(),
              " but mask has size ", mask.sizes());
  const int64_t sparse_dim = self.sparse_dim();
  const at::Tensor self_values = self._values();
  at::Tensor values;
  if (self._nnz() == 0 || mask._nnz() == 0) {
    values = at::zeros_like(self_values);
  } else {
    at::IntArrayRef sparse_sizes = self.sizes().slice(0, sparse_dim);
    auto [unique, inverse, counts] = at::_unique2(
        Linearize(mask._indices(), sparse_sizes), /*sorted=*/true,
        /*return_inverse=*/false, /*return_counts=*/accumulate_matches);
    auto [pos, found] =
        Lookup(unique, Linearize(self._indices(), sparse_sizes));
    at::Tensor factor =
        accumulate_matches ? counts.index_select(0, pos).mul(found) : found;
    std::vector<int64_t> shape(self_values.dim(), 1);
    shape[0] = self._nnz();
    values =
        self_values.mul(factor.to(self_values.scalar_type()).reshape(shape));
  }
  return MakeSparse(self.sizes(), sparse_dim, self._indices().clone(), values,
                    self.is_coalesced());
}

// The gradient of torch.sparse.sum(input, dims) w.r.t. input: grad's entry
// for each of input's positions, with the summed dims dropped. Like the CPU
// kernel it lies on input's coalesced pattern (each position once), so the
// gradient of a duplicated entry is not counted twice downstream.
at::Tensor SparseSumBackward(const at::Tensor& grad, const at::Tensor& input_in,
                             at::IntArrayRef dims) {
  TORCH_CHECK(input_in.is_sparse(),
              "_sparse_sum_backward: input must be sparse");
  const at::Tensor input =
      input_in.is_coalesced() ? input_in : Coalesce(input_in);
  const int64_t sparse_dim = input.sparse_dim();
  const int64_t ndim = input.dim();
  std::vector<bool> summed(ndim, false);
  for (int64_t d : dims) summed.at(d < 0 ? d + ndim : d) = true;
  const at::Tensor indices = input._indices();
  const at::Tensor values = input._values();
  const int64_t nnz = input._nnz();
  // grad as a dense tensor over the dims that were kept.
  const at::Tensor g = grad.is_sparse() ? grad.to_dense() : grad;
  c10::List<std::optional<at::Tensor>> kept;
  for (int64_t d = 0; d < sparse_dim; ++d) {
    if (!summed[d]) kept.push_back(indices.select(0, d));
  }
  at::Tensor per_entry;
  std::vector<int64_t> dense_sizes(input.sizes().begin() + sparse_dim,
                                   input.sizes().end());
  if (kept.empty()) {
    // Every sparse dim was summed: grad has only the kept dense dims.
    std::vector<int64_t> shape = {1};
    for (int64_t d = sparse_dim; d < ndim; ++d)
      shape.push_back(summed[d] ? 1 : input.size(d));
    per_entry = g.reshape(shape);
  } else {
    per_entry = at::index(g, kept);  // [nnz, kept dense dims...]
    std::vector<int64_t> shape = {nnz};
    for (int64_t d = sparse_dim; d < ndim; ++d)
      shape.push_back(summed[d] ? 1 : input.size(d));
    per_entry = per_entry.reshape(shape);
  }
  std::vector<int64_t> value_shape = {nnz};
  value_shape.insert(value_shape.end(), dense_sizes.begin(), dense_sizes.end());
  at::Tensor grad_values =
      per_entry.expand(value_shape).to(values.scalar_type()).contiguous();
  return MakeSparse(input.sizes(), sparse_dim, indices.clone(), grad_values,
                    true);
}

// index_select on a sparse COO tensor. Along a dense dim it selects in the
// values; along a sparse dim each stored entry whose index there equals
// index[j] reappears at position j (pairs enumerated over the sorted index).
at::Tensor SparseIndexSelect(const at::Tensor& self, int64_t dim,
                             const at::Tensor& index) {
  const int64_t ndim = self.dim();
  TORCH_CHECK(ndim > 0,
              "index_select(): cannot select from a 0-dim sparse tensor");
  dim = c10::maybe_wrap_dim(dim, ndim);
  TORCH_CHECK(index.dim() <= 1,
              "index_select(): Index is supposed to be a vector");
  TORCH_CHECK(
      index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
      "index_select(): Expected dtype int32 or int64 for index");
  TORCH_CHECK(!index.is_sparse(),
              "index_select(): index must be a dense tensor");
  const at::Tensor idx = index.reshape({-1}).to(self._indices().options());
  const int64_t sparse_dim = self.sparse_dim();
  const int64_t size = self.size(dim);
  const int64_t m = idx.size(0);
  if (m > 0) {
    const bool bad = idx.lt(0).logical_or_(idx.ge(size)).any().item<bool>();
    TORCH_CHECK_INDEX(!bad, "index_select(): index out of range for dimension ",
                      dim, " of size ", size);
  }
  std::vector<int64_t> sizes = self.sizes().vec();
  sizes[dim] = m;
  const at::Tensor indices = self._indices();
  const at::Tensor values = self._values();
  // As on the CPU, a result is flagged coalesced only when it has at most
  // one entry.
  if (dim >= sparse_dim) {
    return MakeSparse(sizes, sparse_dim, indices.clone(),
                      values.index_select(dim - sparse_dim + 1, idx),
                      self._nnz() < 2);
  }
  const int64_t nnz = self._nnz();
  auto [sorted, order] =
      idx.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor key = indices.select(0, dim);
  const at::Tensor lo = at::searchsorted(sorted, key);
  const at::Tensor hi =
      at::searchsorted(sorted, key, /*out_int32=*/false, /*right=*/true);
  const at::Tensor counts = hi.sub(lo);
  const int64_t total = (nnz == 0 || m == 0) ? 0 : counts.sum().item<int64_t>();
  if (total == 0) {
    std::vector<int64_t> value_shape = values.sizes().vec();
    value_shape[0] = 0;
    return MakeSparse(sizes, sparse_dim,
                      at::empty({sparse_dim, 0}, indices.options()),
                      at::empty(value_shape, values.options()), true);
  }
  auto [which, offset] = EnumeratePairs(counts, total);
  const at::Tensor position =
      order.index_select(0, lo.index_select(0, which).add_(offset));
  at::Tensor new_indices = indices.index_select(1, which);
  new_indices.select(0, dim).copy_(position);
  return MakeSparse(sizes, sparse_dim, new_indices,
                    values.index_select(0, which), total < 2);
}

// The softmax groups of a coalesced sparse tensor along sparse dim `dim`:
// entries that differ only in `dim` form one group.
std::pair<at::Tensor, int64_t> SoftmaxGroups(const at::Tensor& t, int64_t dim) {
  const int64_t sparse_dim = t.sparse_dim();
  const at::Tensor indices = t._indices();
  std::vector<int64_t> keep, keep_sizes;
  for (int64_t d = 0; d < sparse_dim; ++d) {
    if (d == dim) continue;
    keep.push_back(d);
    keep_sizes.push_back(t.size(d));
  }
  if (keep.empty()) return {at::zeros({t._nnz()}, indices.options()), 1};
  const at::Tensor kept =
      indices.index_select(0, at::tensor(keep, at::kLong).to(indices.device()));
  auto [unique, inverse, counts] =
      at::_unique2(Linearize(kept, keep_sizes), /*sorted=*/true,
                   /*return_inverse=*/true,
                   /*return_counts=*/false);
  return {inverse, unique.size(0)};
}

// Per-group sums of `v` ([nnz, dense...]) gathered back to every entry.
at::Tensor GroupSum(const at::Tensor& v, const at::Tensor& group,
                    int64_t groups) {
  std::vector<int64_t> shape = v.sizes().vec();
  shape[0] = groups;
  return at::zeros(shape, v.options())
      .index_add_(0, group, v)
      .index_select(0, group);
}

at::Tensor SparseSoftmaxImpl(const at::Tensor& self_in, int64_t dim,
                             bool half_to_float, bool log) {
  TORCH_CHECK(!half_to_float, log ? "log_" : "",
              "softmax with half to float conversion is ",
              "not supported on tpu for sparse tensors");
  TORCH_CHECK(at::isFloatingType(self_in.scalar_type()),
              "softmax of a sparse tensor takes a floating-point tensor, got ",
              self_in.scalar_type());
  const int64_t ndim = self_in.dim();
  dim = c10::maybe_wrap_dim(dim, ndim);
  const at::Tensor self = Coalesce(self_in);
  const int64_t sparse_dim = self.sparse_dim();
  const at::Tensor values = self._values();
  at::Tensor out;
  if (self._nnz() == 0) {
    out = values.clone();
  } else if (dim >= sparse_dim) {
    out = log ? values.log_softmax(dim - sparse_dim + 1)
              : values.softmax(dim - sparse_dim + 1);
  } else {
    // Only stored entries take part (the others count as -inf).
    auto [group, groups] = SoftmaxGroups(self, dim);
    std::vector<int64_t> shape = values.sizes().vec();
    std::vector<int64_t> view(values.dim(), 1);
    view[0] = values.size(0);
    const at::Tensor expanded = group.view(view).expand_as(values);
    shape[0] = groups;
    const at::Tensor max =
        at::full(shape, -std::numeric_limits<double>::infinity(),
                 values.options())
            .scatter_reduce_(0, expanded, values, "amax", /*include_self=*/true)
            .index_select(0, group);
    const at::Tensor shifted = values.sub(max);
    const at::Tensor e = shifted.exp();
    const at::Tensor sum = GroupSum(e, group, groups);
    out = log ? shifted.sub(sum.log()) : e.div(sum);
  }
  return MakeSparse(self.sizes(), sparse_dim, self._indices().clone(), out,
                    true);
}

at::Tensor SparseSoftmax(const at::Tensor& self, int64_t dim,
                         bool half_to_float) {
  return SparseSoftmaxImpl(self, dim, half_to_float, /*log=*/false);
}

at::Tensor SparseLogSoftmax(const at::Tensor& self, int64_t dim,
                            bool half_to_float) {
  return SparseSoftmaxImpl(self, dim, half_to_float, /*log=*/true);
}

at::Tensor SparseSoftmaxBackwardImpl(const at::Tensor& grad,
                                     const at::Tensor& output, int64_t dim,
                                     bool log) {
  TORCH_CHECK(output.is_sparse() && output.is_coalesced(),
              "sparse softmax backward: expected the coalesced sparse output "
              "of the forward");
  dim = c10::maybe_wrap_dim(dim, output.dim());
  const int64_t sparse_dim = output.sparse_dim();
  const at::Tensor out = output._values();
  // The gradient at the output's entries (zero where grad stores none).
  const at::Tensor g = grad.is_sparse()
                           ? SparseMask(Coalesce(grad), output)._values()
                           : at::index(grad, IndexList(output));
  at::Tensor gi;
  if (output._nnz() == 0) {
    gi = out.clone();
  } else if (dim >= sparse_dim) {
    const int64_t axis = dim - sparse_dim + 1;
    gi = log ? g.sub(out.exp().mul(g.sum(axis, /*keepdim=*/true)))
             : out.mul(g.sub(g.mul(out).sum(axis, /*keepdim=*/true)));
  } else {
    auto [group, groups] = SoftmaxGroups(output, dim);
    gi = log ? g.sub(out.exp().mul(GroupSum(g, group, groups)))
             : out.mul(g.sub(GroupSum(g.mul(out), group, groups)));
  }
  return MakeSparse(output.sizes(), sparse_dim, output._indices().clone(), gi,
                    true);
}

at::Tensor SparseSoftmaxBackward(const at::Tensor& grad,
                                 const at::Tensor& output, int64_t dim,
                                 const at::Tensor&) {
  return SparseSoftmaxBackwardImpl(grad, output, dim, /*log=*/false);
}

at::Tensor SparseLogSoftmaxBackward(const at::Tensor& grad,
                                    const at::Tensor& output, int64_t dim,
                                    const at::Tensor&) {
  return SparseSoftmaxBackwardImpl(grad, output, dim, /*log=*/true);
}

std::string LayoutOf(const torch::jit::Stack& stack, size_t first) {
  for (size_t i = first; i < stack.size(); ++i) {
    if (stack[i].isTensor() && stack[i].toTensor().defined()) {
      const at::Layout l = stack[i].toTensor().layout();
      switch (l) {
        case at::kSparseCsr:
          return "torch.sparse_csr";
        case at::kSparseCsc:
          return "torch.sparse_csc";
        case at::kSparseBsr:
          return "torch.sparse_bsr";
        case at::kSparseBsc:
          return "torch.sparse_bsc";
        case at::kStrided:
        case at::kSparse:
          break;
        default:
          return c10::str(l);
      }
    }
  }
  return "a compressed sparse layout";
}

constexpr char kSupported[] =
    "supported for COO: creation and conversion (to_sparse, to_dense, .to()), "
    "coalesce, "
    "indices/values, sum, elementwise math with a scalar or a dense operand "
    "(add, sub, mul, "
    "div, unary math), sparse.mm/addmm and mm with a dense or sparse right "
    "operand, "
    "index_select, sparse.softmax/log_softmax";

void UnsupportedSparseOp(const c10::OperatorHandle& op,
                         torch::jit::Stack* stack) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "tpu: ", op.schema().operator_name(),
      " is not implemented for sparse COO tensors on tpu (", kSupported,
      "). Convert with .to_dense() first.");
}

void UnsupportedLayout(const c10::OperatorHandle& op,
                       torch::jit::Stack* stack) {
  const size_t args = op.schema().arguments().size();
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "tpu: the sparse layout ", LayoutOf(*stack, stack->size() - args),
      " is not supported on tpu (", op.schema().operator_name(),
      "); tpu tensors are torch.strided or torch.sparse_coo. Use .to_sparse() "
      "for COO or "
      ".to_dense().");
}

at::Tensor DenseToCompressed(const char* layout) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "tpu: the sparse layout ", layout,
      " is not supported on tpu; tpu tensors are torch.strided or "
      "torch.sparse_coo. Use .to_sparse() for COO.");
  return {};
}

TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  for (const char* name : kSharedSparseKernels) {
    m.impl(name,
           torch::CppFunction::makeFromBoxedFunction<&SharedSparseKernel>());
  }
  m.impl("_coalesce", Coalesce);
  m.impl("add.out", AddOut);
  m.impl("mul.out", MulOut);
  m.impl("addmm", Addmm);
  m.impl("addmm.out", AddmmOut);
  m.impl("addmm_", Addmm_);
  m.impl("_sparse_sparse_matmul", SparseSparseMatmul);
  m.impl("_sparse_sum_backward", SparseSumBackward);
  m.impl("sparse_mask", SparseMask);
  m.impl("index_select", SparseIndexSelect);
  m.impl("_sparse_softmax", SparseSoftmax);
  m.impl("_sparse_log_softmax", SparseLogSoftmax);
  m.impl("_sparse_softmax_backward_data", SparseSoftmaxBackward);
  m.impl("_sparse_log_softmax_backward_data", SparseLogSoftmaxBackward);
  m.impl("_sparse_mask_projection", SparseMaskProjection);
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&UnsupportedSparseOp>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&UnsupportedLayout>());
}

// Dense tpu tensors into sparse ones: COO through ATen's generic conversion
// (nonzero and gathers, on tpu), the compressed layouts refused by name.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_sparse.sparse_dim",
         static_cast<at::Tensor (*)(const at::Tensor&, int64_t)>(
             &at::native::dense_to_sparse));
  m.impl("_to_sparse", static_cast<at::Tensor (*)(
                           const at::Tensor&, std::optional<at::Layout>,
                           at::OptionalIntArrayRef, std::optional<int64_t>)>(
                           &at::native::dense_to_sparse));
  m.impl("_to_sparse_csr", [](const at::Tensor&, std::optional<int64_t>) {
    return DenseToCompressed("torch.sparse_csr");
  });
  m.impl("_to_sparse_csc", [](const at::Tensor&, std::optional<int64_t>) {
    return DenseToCompressed("torch.sparse_csc");
  });
  m.impl("_to_sparse_bsr",
         [](const at::Tensor&, at::IntArrayRef, std::optional<int64_t>) {
           return DenseToCompressed("torch.sparse_bsr");
         });
  m.impl("_to_sparse_bsc",
         [](const at::Tensor&, at::IntArrayRef, std::optional<int64_t>) {
           return DenseToCompressed("torch.sparse_bsc");
         });
}

}  // namespace

std::vector<std::string> SharedSparseKernelNames() {
  return {std::begin(kSharedSparseKernels), std::end(kSharedSparseKernels)};
}

}  // namespace torch_tpu

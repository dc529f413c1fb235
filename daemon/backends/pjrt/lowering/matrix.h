// Linear algebra building blocks: matrices are the last two dimensions,
// the ones before a batch. Factorizations (Cholesky, LU, QR), solves and
// Householder reflections, as LAPACK defines them.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_LOWERING_MATRIX_H_
#define TPUD_DAEMON_BACKENDS_PJRT_LOWERING_MATRIX_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"

namespace tpud::pjrt {

// v (dims `in`) with the other triangle zeroed: the lower (i >= j) or upper
// one kept.
std::string Triangle(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& in, bool lower,
                     const HloType& t);

// Cholesky factor of v (dims `in`): lower, or upper (L^T), the other
// triangle zero.
std::string Cholesky(Lowering& l, const std::string& v,
                     const std::vector<int64_t>& in, bool upper,
                     const HloType& t);

// X with op(A) X = B (left) or X op(A) = B: A triangular (dims `ad`), B of
// dims `bd`, both already broadcast to one batch; op(A) is A, or with
// `adjoint` its conjugate transpose (real matrices: the transpose).
std::string TriangularSolve(Lowering& l, const std::string& a,
                            const std::vector<int64_t>& ad,
                            const std::string& b,
                            const std::vector<int64_t>& bd, bool left,
                            bool lower, bool unit, bool adjoint,
                            const HloType& t);

// dims with the batch (all but the last two) replaced by `batch`.
std::vector<int64_t> WithBatch(const std::vector<int64_t>& dims,
                               const std::vector<int64_t>& batch);

// A matrix operand broadcast over `batch`, of type t.
absl::StatusOr<std::string> MatrixOperand(Lowering& l, const tpu::OpArg& a,
                                          const std::vector<int64_t>& batch,
                                          const HloType& t);

// The batch of an output of dims `dims`.
std::vector<int64_t> BatchOf(const std::vector<int64_t>& dims);

// An identity matrix of dims `dims` (the last two equal).
std::string Identity(Lowering& l, const std::vector<int64_t>& dims,
                     const HloType& t);

// v (dims `from`) broadcast to `to`, its dimension q going to map[q].
std::string BroadcastInDim(Lowering& l, const std::string& v,
                           const std::vector<int64_t>& from,
                           const std::vector<int64_t>& to,
                           const std::vector<int64_t>& map, const HloType& t);

// The shapes of a batch of matrices (dims = batch + [m, n]) and the maps
// that broadcast a per-matrix value, a column (length m) or a row (length
// n) over it.
struct MatrixShape {
  std::vector<int64_t> dims, batch, col, row;
  std::vector<int64_t> batch_map, col_map, row_map;
  int64_t m = 0, n = 0;
  explicit MatrixShape(const std::vector<int64_t>& d)
      : dims(d), batch(BatchOf(d)) {
    const int64_t r = static_cast<int64_t>(d.size());
    m = d[r - 2];
    n = d[r - 1];
    col = batch;
    col.push_back(m);
    row = batch;
    row.push_back(n);
    for (int64_t q = 0; q < r - 2; ++q) batch_map.push_back(q);
    col_map = batch_map;
    col_map.push_back(r - 2);
    row_map = batch_map;
    row_map.push_back(r - 1);
  }
  int64_t rank() const { return static_cast<int64_t>(dims.size()); }
};

// The rows `j` and `p` (i64 per matrix, dims batch) of x swapped.
std::string SwapRows(Lowering& l, const std::string& x, const MatrixShape& s,
                     const std::string& j, const std::string& p,
                     const HloType& t);

// A while loop over (state...): `going` emits the loop's condition (an i1
// scalar) from the state, `step` the next state.
std::vector<std::string> WhileLoop(
    Lowering& l, const std::vector<std::string>& init,
    const std::vector<std::string>& types,
    const std::function<std::string(const std::vector<std::string>& state)>&
        going,
    const std::function<
        std::vector<std::string>(const std::vector<std::string>& state)>& step);

// A counted loop: `count` iterations of `step` over (j, state...), j from 0.
// `step` emits the next state from j (an i64 scalar) and the current state.
std::vector<std::string> CountedLoop(
    Lowering& l, int64_t count, const std::vector<std::string>& init,
    const std::vector<std::string>& types,
    const std::function<std::vector<std::string>(
        const std::string& j, const std::vector<std::string>& state)>& step);

// LU factorization with partial pivoting, as LAPACK's getrf: for each
// column j, the first row at or below j of the largest |re| + |im| is swapped
// up, the column below is scaled by the pivot's reciprocal, and the
// trailing block updated. Returns LU, the 1-based pivots (i64, batch +
// [min(m, n)]) and info (i64, batch: the first zero pivot's 1-based order,
// else 0).
struct Lu {
  std::string lu, pivots, info;
};

Lu LuFactor(Lowering& l, const std::string& a, const MatrixShape& s,
            const HloType& t);

// x (dims `s`, m = the pivots' length or more) with LAPACK's row swaps
// applied: row j with row pivots[j] - 1, for j in order (reversed: undone).
std::string ApplySwaps(Lowering& l, const std::string& x, const MatrixShape& s,
                       const std::string& pivots, int64_t k, bool reversed,
                       const HloType& t);

// v (dims `in`) with its last two dimensions swapped.
std::string Transposed(Lowering& l, const std::string& v,
                       const std::vector<int64_t>& in, const HloType& t);

// The conjugate transpose (of real matrices: the transpose).
std::string Adjoint(Lowering& l, const std::string& v,
                    const std::vector<int64_t>& in, const HloType& t);

// Solves A X = B (A^H X = B: adjoint) from A's LU and pivots (B: dims
// `bs`, its batch A's).
std::string LuSolve(Lowering& l, const std::string& lu,
                    const std::vector<int64_t>& ad, const std::string& pivots,
                    const std::string& b, const MatrixShape& bs, bool adjoint,
                    const HloType& t);

// The Householder vector of column j of a (LAPACK's storage: 1 at row j,
// a's column below it), for rows at or below j, zero above.
std::string ReflectorOf(Lowering& l, const std::string& a, const MatrixShape& s,
                        const std::string& j, const HloType& t);

// (I - tau v v^H) c: v a column (dims cs.col), tau one per matrix.
std::string Reflect(Lowering& l, const std::string& c, const MatrixShape& cs,
                    const std::string& v, const std::string& tau,
                    const HloType& t);

// Element j of per-matrix vectors (dims batch + [k]).
std::string ElementAt(Lowering& l, const std::string& v,
                      const std::vector<int64_t>& vd, const std::string& j,
                      const HloType& t);

// QR by Householder reflections, as LAPACK's geqrf stores it: R on and
// above the diagonal, each reflector's vector below it, and tau.
struct Qr {
  std::string a, tau;
};

Qr Geqrf(Lowering& l, const std::string& a, const MatrixShape& s,
         const HloType& t);

// Q c = H_0 ... H_{k-1} c (H_{k-1} applied first), or Q^H c =
// H_{k-1}^H ... H_0^H c (transposed): the reflectors of `a` (dims `as`)
// and tau (batch + [k]).
std::string ApplyQ(Lowering& l, const std::string& a, const MatrixShape& as,
                   const std::string& tau, int64_t k, const std::string& c,
                   const MatrixShape& cs, bool transposed, const HloType& t);

// +1 or -1 per matrix: the parity of the row swaps the pivots record.
std::string SwapSign(Lowering& l, const std::string& pivots,
                     const std::vector<int64_t>& batch, int64_t k,
                     const HloType& t);

// The diagonal of square matrices (dims `s`): batch + [n].
std::string Diagonal(Lowering& l, const std::string& x, const MatrixShape& s,
                     const HloType& t);

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_LOWERING_MATRIX_H_

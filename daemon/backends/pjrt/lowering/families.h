// The op families: each registers its ops' entries (registry.h). A new
// family adds its function here and to Registry() in registry.cc.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_LOWERING_FAMILIES_H_
#define TPUD_DAEMON_BACKENDS_PJRT_LOWERING_FAMILIES_H_

namespace tpud::pjrt {

class OpRegistry;

void RegisterElementwise(OpRegistry& reg);  // elementwise.cc
void RegisterActivation(OpRegistry& reg);   // activation.cc
void RegisterReduction(OpRegistry& reg);    // reduction.cc
void RegisterSort(OpRegistry& reg);         // sort.cc
void RegisterLinalg(OpRegistry& reg);       // linalg.cc
void RegisterNn(OpRegistry& reg);           // nn.cc
void RegisterForeach(OpRegistry& reg);      // foreach.cc
void RegisterShape(OpRegistry& reg);        // shape.cc
void RegisterIndexing(OpRegistry& reg);     // indexing.cc
void RegisterRandom(OpRegistry& reg);       // random.cc
void RegisterSpecial(OpRegistry& reg);      // special.cc
void RegisterFft(OpRegistry& reg);          // fft.cc
void RegisterPolynomial(OpRegistry& reg);   // polynomial.cc
void RegisterEigen(OpRegistry& reg);        // eigen.cc
void RegisterResample(OpRegistry& reg);     // resample.cc
void RegisterBessel(OpRegistry& reg);       // bessel.cc
void RegisterNnBackward(OpRegistry& reg);   // nn_backward.cc
void RegisterSegment(OpRegistry& reg);      // segment.cc
void RegisterGamma(OpRegistry& reg);        // gamma.cc
void RegisterMatrixExp(OpRegistry& reg);    // matrix_exp.cc
void RegisterHostOps(OpRegistry& reg);      // ../host_ops.cc

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_LOWERING_FAMILIES_H_

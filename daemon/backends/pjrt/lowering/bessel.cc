// The Bessel functions of the first and second kind J0, J1, Y0, Y1 and the
// modified ones of the second kind K0, K1 (and exp(x)-scaled), evaluated
// in float64 with the rational and Chebyshev approximations of the Cephes
// library that ATen evaluates too: one form near zero, an asymptotic one
// beyond (|x| > 5, or x > 2 for K), picked per element.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/backends/pjrt/lowering/families.h"
#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"
#include "daemon/backends/pjrt/lowering/registry.h"
#include "daemon/backends/pjrt/lowering/special.h"

namespace tpud::pjrt {
namespace {

// Cephes's coefficients (j0.c, j1.c, k0.c, k1.c), highest power first. The
// asymptotic P and Q tables serve J and Y of the same order.
constexpr double kJ0P[] = {
    +7.96936729297347051624e-04, +8.28352392107440799803e-02,
    +1.23953371646414299388,     +5.44725003058768775090,
    +8.74716500199817011941,     +5.30324038235394892183,
    +9.99999999999999997821e-01};
constexpr double kJ0Pd[] = {
    +9.24408810558863637013e-04, +8.56288474354474431428e-02,
    +1.25352743901058953537,     +5.47097740330417105182,
    +8.76190883237069594232,     +5.30605288235394617618,
    +1.00000000000000000218};
constexpr double kJ0Q[] = {
    -1.13663838898469149931e-02, -1.28252718670509318512,
    -1.95539544257735972385e+01, -9.32060152123768231369e+01,
    -1.77681167980488050595e+02, -1.47077505154951170175e+02,
    -5.14105326766599330220e+01, -6.05014350600728481186};
constexpr double kJ0Qd[] = {
    +6.43178256118178023184e+01, +8.56430025976980587198e+02,
    +3.88240183605401609683e+03, +7.24046774195652478189e+03,
    +5.93072701187316984827e+03, +2.06209331660327847417e+03,
    +2.42005740240291393179e+02};
constexpr double kJ0R[] = {
    -4.79443220978201773821e+09, +1.95617491946556577543e+12,
    -2.49248344360967716204e+14, +9.70862251047306323952e+15};
constexpr double kJ0Rd[] = {
    +4.99563147152651017219e+02, +1.73785401676374683123e+05,
    +4.84409658339962045305e+07, +1.11855537045356834862e+10,
    +2.11277520115489217587e+12, +3.10518229857422583814e+14,
    +3.18121955943204943306e+16, +1.71086294081043136091e+18};
constexpr double kY0Y[] = {
    +1.55924367855235737965e+04, -1.46639295903971606143e+07,
    +5.43526477051876500413e+09, -9.82136065717911466409e+11,
    +8.75906394395366999549e+13, -3.46628303384729719441e+15,
    +4.42733268572569800351e+16, -1.84950800436986690637e+16};
constexpr double kY0Yd[] = {
    +1.04128353664259848412e+03, +6.26107330137134956842e+05,
    +2.68919633393814121987e+08, +8.64002487103935000337e+10,
    +2.02979612750105546709e+13, +3.17157752842975028269e+15,
    +2.50596256172653059228e+17};
constexpr double kJ1P[] = {
    +7.62125616208173112003e-04, +7.31397056940917570436e-02,
    +1.12719608129684925192,     +5.11207951146807644818,
    +8.42404590141772420927,     +5.21451598682361504063,
    +1.00000000000000000254};
constexpr double kJ1Pd[] = {
    +5.71323128072548699714e-04, +6.88455908754495404082e-02,
    +1.10514232634061696926,     +5.07386386128601488557,
    +8.39985554327604159757,     +5.20982848682361821619,
    +9.99999999999999997461e-01};
constexpr double kJ1Q[] = {
    +5.10862594750176621635e-02, +4.98213872951233449420,
    +7.58238284132545283818e+01, +3.66779609360150777800e+02,
    +7.10856304998926107277e+02, +5.97489612400613639965e+02,
    +2.11688757100572135698e+02, +2.52070205858023719784e+01};
constexpr double kJ1Qd[] = {
    +7.42373277035675149943e+01, +1.05644886038262816351e+03,
    +4.98641058337653607651e+03, +9.56231892404756170795e+03,
    +7.99704160447350683650e+03, +2.82619278517639096600e+03,
    +3.36093607810698293419e+02};
constexpr double kJ1R[] = {
    -8.99971225705559398224e+08, +4.52228297998194034323e+11,
    -7.27494245221818276015e+13, +3.68295732863852883286e+15};
constexpr double kJ1Rd[] = {
    +6.20836478118054335476e+02, +2.56987256757748830383e+05,
    +8.35146791431949253037e+07, +2.21511595479792499675e+10,
    +4.74914122079991414898e+12, +7.84369607876235854894e+14,
    +8.95222336184627338078e+16, +5.32278620332680085395e+18};
constexpr double kY1Y[] = {
    +1.26320474790178026440e+09, -6.47355876379160291031e+11,
    +1.14509511541823727583e+14, -8.12770255501325109621e+15,
    +2.02439475713594898196e+17, -7.78877196265950026825e+17};
constexpr double kY1Yd[] = {
    +5.94301592346128195359e+02, +2.35564092943068577943e+05,
    +7.34811944459721705660e+07, +1.87601316108706159478e+10,
    +3.88231277496238566008e+12, +6.20557727146953693363e+14,
    +6.87141087355300489866e+16, +3.97270608116560655612e+18};
constexpr double kK0A[] = {
    +1.37446543561352307156e-16, +4.25981614279661018399e-14,
    +1.03496952576338420167e-11, +1.90451637722020886025e-09,
    +2.53479107902614945675e-07, +2.28621210311945178607e-05,
    +1.26461541144692592338e-03, +3.59799365153615016266e-02,
    +3.44289899924628486886e-01, -5.35327393233902768720e-01};
constexpr double kK0B[] = {
    +5.30043377268626276149e-18, -1.64758043015242134646e-17,
    +5.21039150503902756861e-17, -1.67823109680541210385e-16,
    +5.51205597852431940784e-16, -1.84859337734377901440e-15,
    +6.34007647740507060557e-15, -2.22751332699166985548e-14,
    +8.03289077536357521100e-14, -2.98009692317273043925e-13,
    +1.14034058820847496303e-12, -4.51459788337394416547e-12,
    +1.85594911495471785253e-11, -7.95748924447710747776e-11,
    +3.57739728140030116597e-10, -1.69753450938905987466e-09,
    +8.57403401741422608519e-09, -4.66048989768794782956e-08,
    +2.76681363944501510342e-07, -1.83175552271911948767e-06,
    +1.39498137188764993662e-05, -1.28495495816278026384e-04,
    +1.56988388573005337491e-03, -3.14481013119645005427e-02,
    +2.44030308206595545468};
constexpr double kK1A[] = {
    -7.02386347938628759343e-18, -2.42744985051936593393e-15,
    -6.66690169419932900609e-13, -1.41148839263352776110e-10,
    -2.21338763073472585583e-08, -2.43340614156596823496e-06,
    -1.73028895751305206302e-04, -6.97572385963986435018e-03,
    -1.22611180822657148235e-01, -3.53155960776544875667e-01,
    +1.52530022733894777053};
constexpr double kK1B[] = {
    -5.75674448366501715755e-18, +1.79405087314755922667e-17,
    -5.68946255844285935196e-17, +1.83809354436663880070e-16,
    -6.05704724837331885336e-16, +2.03870316562433424052e-15,
    -7.01983709041831346144e-15, +2.47715442448130437068e-14,
    -8.97670518232499435011e-14, +3.34841966607842919884e-13,
    -1.28917396095102890680e-12, +5.13963967348173025100e-12,
    -2.12996783842756842877e-11, +9.21831518760500529508e-11,
    -4.19035475934189648750e-10, +2.01504975519703286596e-09,
    -1.03457624656780970260e-08, +5.74108412545004946722e-08,
    -3.50196060308781257119e-07, +2.40648494783721712015e-06,
    -1.93619797416608296024e-05, +1.95215518471351631108e-04,
    -2.85781685962277938680e-03, +1.03923736576817238437e-01,
    +2.72062619048444266945};

constexpr double kPiOver4 = 0.785398163397448309615660845819875721;
constexpr double k3PiOver4 = 2.356194490192344928846982537459627163;
constexpr double kSqrt2OverPi = 0.797884560802865355879892119868763737;
constexpr double k2OverPi = 0.636619772367581343075535053490057448;

// Everything below is float64, of the elements' dims.
class F64Math {
 public:
  F64Math(Lowering& l, const std::vector<int64_t>& d) : l_(l), d_(d) {}
  std::string C(double v) { return l_.Constant(v, d_, F64()); }
  std::string Add(const std::string& a, const std::string& b) {
    return l_.Binary("add", a, b, d_, F64());
  }
  std::string Sub(const std::string& a, const std::string& b) {
    return l_.Binary("subtract", a, b, d_, F64());
  }
  std::string Mul(const std::string& a, const std::string& b) {
    return l_.Binary("multiply", a, b, d_, F64());
  }
  std::string Div(const std::string& a, const std::string& b) {
    return l_.Binary("divide", a, b, d_, F64());
  }
  std::string Fn(const char* op, const std::string& a) {
    return l_.Unary(op, a, d_, F64());
  }
  std::string Less(const std::string& a, double b) {
    return l_.Compare("LT", a, C(b), d_, F64());
  }
  std::string LessEq(const std::string& a, double b) {
    return l_.Compare("LE", a, C(b), d_, F64());
  }
  std::string Eq(const std::string& a, double b) {
    return l_.Compare("EQ", a, C(b), d_, F64());
  }
  std::string Pick(const std::string& pred, const std::string& a,
                   const std::string& b) {
    return l_.Select(pred, a, b, d_, F64());
  }
  // The polynomial with coefficients c (highest power first) at z.
  template <size_t N>
  std::string Poly(const double (&c)[N], const std::string& z) {
    std::string r = C(c[0]);
    for (size_t i = 1; i < N; ++i) r = Add(Mul(r, z), C(c[i]));
    return r;
  }
  template <size_t N, size_t M>
  std::string Ratio(const double (&p)[N], const double (&q)[M],
                    const std::string& z) {
    return Div(Poly(p, z), Poly(q, z));
  }
  template <size_t N>
  std::string Cheb(const double (&c)[N], const std::string& y) {
    return Chebyshev(l_, y, c, d_, F64());
  }
  Lowering& l() { return l_; }
  const std::vector<int64_t>& d() const { return d_; }

 private:
  Lowering& l_;
  const std::vector<int64_t>& d_;
};

// The asymptotic form of J (cosine first) or Y (sine first) of order 0 or
// 1 at x > 0: sqrt(2 / (pi x)) (P cos(x - phase) -/+ (5 / x) Q sin(...)).
std::string Asymptotic(F64Math& m, const std::string& x, int order,
                       bool second_kind) {
  const std::string w = m.Mul(m.Div(m.C(5), x), m.Div(m.C(5), x));  // (5 / x)^2
  const std::string p =
      order == 0 ? m.Ratio(kJ0P, kJ0Pd, w) : m.Ratio(kJ1P, kJ1Pd, w);
  const std::string q =
      order == 0 ? m.Ratio(kJ0Q, kJ0Qd, w) : m.Ratio(kJ1Q, kJ1Qd, w);
  const std::string xn = m.Sub(x, m.C(order == 0 ? kPiOver4 : k3PiOver4));
  const std::string s = m.Fn("sine", xn), c = m.Fn("cosine", xn);
  const std::string fq = m.Mul(m.Div(m.C(5), x), q);
  const std::string sum = second_kind ? m.Add(m.Mul(p, s), m.Mul(fq, c))
                                      : m.Sub(m.Mul(p, c), m.Mul(fq, s));
  return m.Div(m.Mul(sum, m.C(kSqrt2OverPi)), m.Fn("sqrt", x));
}

std::string J0(F64Math& m, const std::string& x) {
  const std::string ax = m.Fn("abs", x), z = m.Mul(ax, ax);
  const std::string tiny = m.Sub(m.C(1), m.Div(z, m.C(4)));
  const std::string near = m.Mul(m.Mul(m.Sub(z, m.C(5.78318596294678452118)),
                                       m.Sub(z, m.C(30.4712623436620863991))),
                                 m.Ratio(kJ0R, kJ0Rd, z));
  return m.Pick(m.LessEq(ax, 5), m.Pick(m.Less(ax, 1e-5), tiny, near),
                Asymptotic(m, ax, 0, false));
}

std::string J1(F64Math& m, const std::string& x) {
  const std::string ax = m.Fn("abs", x), z = m.Mul(ax, ax);
  const std::string near = m.Mul(m.Mul(m.Mul(m.Ratio(kJ1R, kJ1Rd, z), ax),
                                       m.Sub(z, m.C(14.6819706421238932572))),
                                 m.Sub(z, m.C(49.2184563216946036703)));
  const std::string r =
      m.Pick(m.LessEq(ax, 5), near, Asymptotic(m, ax, 1, false));
  return m.Pick(m.Less(x, 0), m.Fn("negate", r), r);  // J1 is odd
}

// Y0 and Y1: -inf at 0, NaN below it.
std::string AtZeroAndBelow(F64Math& m, const std::string& x,
                           const std::string& r) {
  return m.Pick(m.Eq(x, 0), m.Div(m.C(-1), m.C(0)),
                m.Pick(m.Less(x, 0), m.Div(m.C(0), m.C(0)), r));
}

std::string Y0(F64Math& m, const std::string& x) {
  const std::string z = m.Mul(x, x);
  const std::string near =
      m.Add(m.Ratio(kY0Y, kY0Yd, z),
            m.Mul(m.Mul(m.C(k2OverPi), m.Fn("log", x)), J0(m, x)));
  return AtZeroAndBelow(
      m, x, m.Pick(m.LessEq(x, 5), near, Asymptotic(m, x, 0, true)));
}

std::string Y1(F64Math& m, const std::string& x) {
  const std::string z = m.Mul(x, x);
  const std::string near =
      m.Add(m.Mul(x, m.Ratio(kY1Y, kY1Yd, z)),
            m.Mul(m.C(k2OverPi),
                  m.Sub(m.Mul(J1(m, x), m.Fn("log", x)), m.Div(m.C(1), x))));
  return AtZeroAndBelow(
      m, x, m.Pick(m.LessEq(x, 5), near, Asymptotic(m, x, 1, true)));
}

// K0 and K1, or exp(x) times them (scaled): inf at 0, NaN below it. Near
// zero they take I0 / I1 (as exp(|x|) I0e, exp(|x|) i1e).
std::string K(F64Math& m, const std::string& x, int order, bool scaled) {
  const std::string y_near = m.Sub(m.Mul(x, x), m.C(2));
  const std::string y_far = m.Sub(m.Div(m.C(8), x), m.C(2));
  const std::string ex = m.Fn("exponential", x);
  const std::string log_half = m.Fn("log", m.Mul(m.C(0.5), x));
  std::string near;
  if (order == 0) {
    const std::string i0 = m.Mul(ex, I0e(m.l(), x, m.d(), F64()));
    near = m.Sub(m.Cheb(kK0A, y_near), m.Mul(log_half, i0));
  } else {
    const std::string i1 =
        m.Mul(ex, Chlo(m.l(), "bessel_i1e", {x}, m.d(), F64()));
    near = m.Add(m.Mul(log_half, i1), m.Div(m.Cheb(kK1A, y_near), x));
  }
  std::string far = m.Div(
      order == 0 ? m.Cheb(kK0B, y_far) : m.Cheb(kK1B, y_far), m.Fn("sqrt", x));
  if (scaled) {
    near = m.Mul(near, ex);
  } else {
    far = m.Mul(m.Fn("exponential", m.Fn("negate", x)), far);
  }
  const std::string r = m.Pick(m.LessEq(x, 2), near, far);
  return m.Pick(m.Eq(x, 0), m.Div(m.C(1), m.C(0)),
                m.Pick(m.Less(x, 0), m.Div(m.C(0), m.C(0)), r));
}

// Airy's Ai, as Cephes' airy.c (ATen's airy_ai): below -2.09 its
// oscillating asymptotic form, from 2.09 its decaying one, between them
// its power series (20 terms: the 13th is below 1e-16 there).
constexpr double kAiN[] = {
    +3.46538101525629032477e-01, +1.20075952739645805542e+01,
    +7.62796053615234516538e+01, +1.68089224934630576269e+02,
    +1.59756391350164413639e+02, +7.05360906840444183113e+01,
    +1.40264691163389668864e+01, +9.99999999999999995305e-01};
constexpr double kAiD[] = {
    +5.67594532638770212846e-01, +1.47562562584847203173e+01,
    +8.45138970141474626562e+01, +1.77318088145400459522e+02,
    +1.64234692871529701831e+02, +7.14778400825575695274e+01,
    +1.40959135607834029598e+01, +1.00000000000000000470e+00};
constexpr double kAiFN[] = {
    -1.31696323418331795333e-01, -6.26456544431912369773e-01,
    -6.93158036036933542233e-01, -2.79779981545119124951e-01,
    -4.91900132609500318020e-02, -4.06265923594885404393e-03,
    -1.59276496239262096340e-04, -2.77649108155232920844e-06,
    -1.67787698489114633780e-08};
constexpr double kAiFD[] = {
    +1.33560420706553243746e+01, +3.26825032795224613948e+01,
    +2.67367040941499554804e+01, +9.18707402907259625840e+00,
    +1.47529146771666414581e+00, +1.15687173795188044134e-01,
    +4.40291641615211203805e-03, +7.54720348287414296618e-05,
    +4.51850092970580378464e-07};
constexpr double kAiGN[] = {
    +1.97339932091685679179e-02, +3.91103029615688277255e-01,
    +1.06579897599595591108e+00, +9.39169229816650230044e-01,
    +3.51465656105547619242e-01, +6.33888919628925490927e-02,
    +5.85804113048388458567e-03, +2.82851600836737019778e-04,
    +6.98793669997260967291e-06, +8.11789239554389293311e-08,
    +3.41551784765923618484e-10};
constexpr double kAiGD[] = {
    +9.30892908077441974853e+00, +1.98352928718312140417e+01,
    +1.55646628932864612953e+01, +5.47686069422975497931e+00,
    +9.54293611618961883998e-01, +8.64580826352392193095e-02,
    +4.12656523824222607191e-03, +1.01259085116509135510e-04,
    +1.17166733214413521882e-06, +4.91834570062930015649e-09};
constexpr double kInvSqrtPi = 5.64189583547756286948e-01;

std::string AiryAi(F64Math& m, const std::string& x) {
  // x < -2.09: with zeta = 2 (-x)^1.5 / 3 and z = 1 / zeta.
  const std::string nx = m.Fn("negate", x);
  const std::string zeta_n =
      m.Div(m.Mul(m.Mul(m.C(2), nx), m.Fn("sqrt", nx)), m.C(3));
  const std::string z = m.Div(m.C(1), zeta_n), zz = m.Mul(z, z);
  const std::string t = m.Add(zeta_n, m.C(kPiOver4));
  const std::string osc = m.Mul(
      m.Div(m.C(kInvSqrtPi), m.Fn("sqrt", m.Fn("sqrt", nx))),
      m.Sub(m.Mul(m.Fn("sine", t),
                  m.Add(m.C(1), m.Mul(zz, m.Ratio(kAiFN, kAiFD, zz)))),
            m.Mul(m.Fn("cosine", t), m.Mul(z, m.Ratio(kAiGN, kAiGD, zz)))));
  // x >= 2.09: zeta = 2 x^1.5 / 3.
  const std::string zeta =
      m.Div(m.Mul(m.Mul(m.C(2), x), m.Fn("sqrt", x)), m.C(3));
  const std::string decay =
      m.Div(m.Mul(m.C(kInvSqrtPi), m.Ratio(kAiN, kAiD, m.Div(m.C(1), zeta))),
            m.Mul(m.Mul(m.C(2), m.Fn("sqrt", m.Fn("sqrt", x))),
                  m.Fn("exponential", zeta)));
  // Between: Ai = c1 f - c2 g, f and g the series in x^3.
  const std::string x3 = m.Mul(m.Mul(x, x), x);
  std::string f = m.C(1), g = x, a = m.C(1), b = x;
  double k = 1;
  for (int i = 0; i < 20; ++i) {
    a = m.Div(m.Mul(a, x3), m.C(k + 1));
    b = m.Div(m.Mul(b, x3), m.C(k + 2));
    a = m.Div(a, m.C(k + 2));
    b = m.Div(b, m.C(k + 3));
    f = m.Add(f, a);
    g = m.Add(g, b);
    k += 3;
  }
  const std::string series = m.Sub(m.Mul(m.C(0.355028053887817239260), f),
                                   m.Mul(m.C(0.258819403792806798405), g));
  const std::string r =
      m.Pick(m.Less(x, -2.09), osc,
             m.Pick(m.Less(x, 2.09), series,
                    m.Pick(m.l().Compare("GT", x, m.C(103.892), m.d(), F64()),
                           m.C(0), decay)));
  // Either infinity gives NaN.
  return m.Pick(
      m.l().Compare("EQ", m.Fn("abs", x), m.Div(m.C(1), m.C(0)), m.d(), F64()),
      m.Div(m.C(0), m.C(0)), r);
}

using BesselFn = std::string (*)(F64Math&, const std::string&);

Rule Bessel(BesselFn f) {
  return InFloat64([f](Lowering& l, const std::string& x,
                       const std::vector<int64_t>& d, const HloType&) {
    F64Math m(l, d);
    return f(m, x);
  });
}

}  // namespace

void RegisterBessel(OpRegistry& reg) {
  reg.Add("aten::special_bessel_j0", Bessel(J0));
  reg.Add("aten::special_airy_ai", Bessel(AiryAi));
  reg.Add("aten::special_bessel_j1", Bessel(J1));
  reg.Add("aten::special_bessel_y0", Bessel(Y0));
  reg.Add("aten::special_bessel_y1", Bessel(Y1));
  reg.Add("aten::special_modified_bessel_k0",
          Bessel([](F64Math& m, const std::string& x) {
            return K(m, x, 0, false);
          }));
  reg.Add("aten::special_modified_bessel_k1",
          Bessel([](F64Math& m, const std::string& x) {
            return K(m, x, 1, false);
          }));
  reg.Add("aten::special_scaled_modified_bessel_k0",
          Bessel([](F64Math& m, const std::string& x) {
            return K(m, x, 0, true);
          }));
  reg.Add("aten::special_scaled_modified_bessel_k1",
          Bessel([](F64Math& m, const std::string& x) {
            return K(m, x, 1, true);
          }));
}

}  // namespace tpud::pjrt

// A device-memory program in pieces (Lowering::DeviceProgram): its main's
// parameters, results and body, so that one op's module and a graph's
// functions are both built from them (a graph composes its ops' programs
// without reading their text back).
#ifndef TPUD_DAEMON_BACKENDS_PJRT_LOWERING_PROGRAM_H_
#define TPUD_DAEMON_BACKENDS_PJRT_LOWERING_PROGRAM_H_

#include <string>
#include <vector>

namespace tpud::pjrt {

struct ProgramPieces {
  struct Param {
    std::string name;  // "%s0", with its %
    std::string type;  // "tensor<64xui8>"
    int alias = -1;    // the result it is donated to (-1: not donated)
  };
  std::vector<Param> params;
  std::vector<std::string> results;       // the values returned, in order
  std::vector<std::string> result_types;  // their types
  std::string body;  // the ops, each a line "    %x = ...\n"

  std::vector<std::string> ParamTypes() const;
  // The op's own module: main, public, its segments donated.
  std::string Module() const;
  // The program as function `name` of a graph's module: private, without
  // donation (the graph's main donates).
  std::string Function(const std::string& name) const;
};

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_LOWERING_PROGRAM_H_

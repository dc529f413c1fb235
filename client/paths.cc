#include "tpu/paths.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace tpu {

std::string DefaultSocketDir() {
  if (geteuid() == 0) return "/run/tpud";
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg != '\0') return absl::StrCat(xdg, "/tpud");
  return absl::StrCat("/tmp/tpud-", geteuid());
}

std::string RuntimeSocketPath() {
  const char* env = std::getenv("TPUD_SOCKET");
  if (env != nullptr && *env != '\0') return env;
  return DefaultSocketDir() + "/tpud.sock";
}

std::string AdminSocketPath() {
  const char* env = std::getenv("TPUD_ADMIN_SOCKET");
  if (env != nullptr && *env != '\0') return env;
  return DefaultSocketDir() + "/admin.sock";
}

}  // namespace tpu

// The old name of registry.h, kept while daemon/service (being restructured
// at the same time) still includes it. Include registry.h instead; remove
// this header and the :communicators alias once nothing uses them.
#ifndef TPUD_DAEMON_COLLECTIVES_COMMUNICATORS_H_
#define TPUD_DAEMON_COLLECTIVES_COMMUNICATORS_H_

#include "daemon/collectives/registry.h"

#endif  // TPUD_DAEMON_COLLECTIVES_COMMUNICATORS_H_

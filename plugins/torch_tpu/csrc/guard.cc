// Device guard, streams and events for "tpu"
// (c10::impl::DeviceGuardImplInterface).
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "runtime.h"

namespace torch_tpu {
namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

struct TpuEvent {
  tpu::Event event;
  bool recorded = false;
};

class TpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kTpu; }

  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(kTpu, CurrentDevice());
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kTpu, "tpu: expected a tpu device, got ", d);
    SetDevice(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    try {
      SetDevice(d.index());
    } catch (...) {
    }
  }

  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, CurrentStreamId(d.index()));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return getNewStream(d, 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    // Streams 1..7 of the session, round robin (0 is the default stream).
    static std::atomic<int> next{0};
    if (!d.has_index()) d = c10::Device(kTpu, CurrentDevice());
    return c10::Stream(c10::Stream::UNSAFE, d,
                       1 + next.fetch_add(1) % (tpu::kNumStreams - 1));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    SetCurrentStreamId(s.device_index(), s.id());
    return old;
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return DeviceCount();
  }

  void destroyEvent(void* event,
                    const c10::DeviceIndex) const noexcept override {
    auto* e = static_cast<TpuEvent*>(event);
    if (e == nullptr) return;
    if (e->recorded) {
      try {
        GetSession().ReleaseEvent(e->event);
      } catch (...) {
      }
    }
    delete e;
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    auto* e = static_cast<TpuEvent*>(*event);
    if (e == nullptr) {
      e = new TpuEvent();
      *event = e;
    } else if (e->recorded) {
      GetSession().ReleaseEvent(e->event);
      e->recorded = false;
    }
    absl::StatusOr<tpu::Event> ev =
        GetSession().RecordEvent(SessionStream(stream.id()));
    Check(ev.status(), "recording an event");
    e->event = *ev;
    e->recorded = true;
  }

  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<TpuEvent*>(event);
    if (e == nullptr || !e->recorded) return;
    Check(GetSession().WaitEvent(SessionStream(stream.id()), e->event),
          "waiting on an event");
  }

  bool queryEvent(void* event) const override {
    auto* e = static_cast<TpuEvent*>(event);
    return e == nullptr || !e->recorded || GetSession().EventDone(e->event);
  }

  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<TpuEvent*>(event);
    if (e == nullptr || !e->recorded) return;
    Check(GetSession().SynchronizeEvent(e->event), "synchronizing an event");
  }

  double elapsedTime(void* start, void* end,
                     const c10::DeviceIndex) const override {
    auto* a = static_cast<TpuEvent*>(start);
    auto* b = static_cast<TpuEvent*>(end);
    TORCH_CHECK(a != nullptr && b != nullptr && a->recorded && b->recorded,
                "tpu: both events must be recorded before elapsed_time");
    absl::StatusOr<double> ms = GetSession().ElapsedMillis(a->event, b->event);
    Check(ms.status(), "elapsed time");
    return *ms;
  }

  bool queryStream(const c10::Stream& stream) const override {
    // Done when everything enqueued so far has completed.
    absl::StatusOr<tpu::Event> ev =
        GetSession().RecordEvent(SessionStream(stream.id()));
    if (!ev.ok()) return true;
    bool done = GetSession().EventDone(*ev);
    GetSession().ReleaseEvent(*ev);
    return done;
  }

  void synchronizeStream(const c10::Stream& stream) const override {
    Check(GetSession().Synchronize(SessionStream(stream.id())), "synchronize");
  }

  void synchronizeDevice(const c10::DeviceIndex) const override {
    Check(GetSession().SynchronizeAll(), "synchronize");
  }

  void recordDataPtrOnStream(const c10::DataPtr&,
                             const c10::Stream&) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuardImpl);

}  // namespace
}  // namespace torch_tpu

#include "daemon/metrics/rpc_status_counts.h"

#include <grpcpp/support/interceptor.h>

namespace tpud {
namespace {

namespace gx = grpc::experimental;

class StatusInterceptor : public gx::Interceptor {
 public:
  explicit StatusInterceptor(RpcStatusCounts* counts) : counts_(counts) {}
  void Intercept(gx::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            gx::InterceptionHookPoints::PRE_SEND_STATUS)) {
      counts_->Add(static_cast<int>(methods->GetSendStatus().error_code()));
    }
    methods->Proceed();
  }

 private:
  RpcStatusCounts* counts_;
};

class StatusInterceptorFactory : public gx::ServerInterceptorFactoryInterface {
 public:
  explicit StatusInterceptorFactory(RpcStatusCounts* counts)
      : counts_(counts) {}
  gx::Interceptor* CreateServerInterceptor(gx::ServerRpcInfo*) override {
    return new StatusInterceptor(counts_);
  }

 private:
  RpcStatusCounts* counts_;
};

}  // namespace

std::unique_ptr<gx::ServerInterceptorFactoryInterface> CountRpcStatuses(
    RpcStatusCounts* counts) {
  return std::make_unique<StatusInterceptorFactory>(counts);
}

}  // namespace tpud

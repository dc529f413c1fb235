#include "bench/ping_baseline.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include "bench/ping.grpc.pb.h"

namespace tpud_bench {
namespace {

class PingService final : public tpud::bench::BenchPing::Service {
  grpc::Status Ping(grpc::ServerContext*, const tpud::bench::PingMessage* req,
                    tpud::bench::PingMessage* resp) override {
    resp->set_sequence(req->sequence());
    return grpc::Status::OK;
  }
};

}  // namespace

pid_t ForkPingServer(const std::string& path) {
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid != 0) {
    for (int i = 0; i < 500 && access(path.c_str(), F_OK) != 0; ++i)
      usleep(10000);
    return pid;
  }
  // The server ends with the bench, however the bench ends (an error's exit
  // too): left behind, it would hold the bench's stdout open and its caller
  // (sharing_bench.py) would wait on it until its timeout.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(1);
  PingService service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) _exit(1);
  server->Wait();
  _exit(0);
}

void StopPingServer(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

struct PingClient::Impl {
  std::unique_ptr<tpud::bench::BenchPing::Stub> stub;
};

PingClient::PingClient(const std::string& path) : impl_(new Impl) {
  impl_->stub = tpud::bench::BenchPing::NewStub(
      grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials()));
}

PingClient::~PingClient() = default;

double PingClient::MicrosPerCall(int n) {
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    grpc::ClientContext ctx;
    tpud::bench::PingMessage req, resp;
    req.set_sequence(i);
    if (!impl_->stub->Ping(&ctx, req, &resp).ok()) std::abort();
  }
  auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(end - start).count() / n;
}

}  // namespace tpud_bench

// wan_step: one published version of bench/wan/run.py, timed from the inside. Connects to the
// publisher's and every subscriber's Control (unix sockets work across network namespaces), starts
// a WaitVersion on every subscriber, then calls Publish, and prints one JSON object:
//   {"publish_start_unix_ns", "publish_return_unix_ns", "publish": PublishResponse,
//    "waits": [{"end_unix_ns", "version", "version_digest"}...],
//    "publisher_status": StatusResponse, "subscriber_status": [StatusResponse...],
//    "verify": [VerifyResponse without tensors...]}   (verify only with --verify)
// Messages are printed with proto field names (64-bit integers as JSON strings, as protobuf's JSON
// mapping does).
//   wan_step --publisher ADDR --subscriber ADDR [--subscriber ADDR]... --version N
//            --safetensors FILE [--timeout S] [--verify]
// Exit 0; 1 when a call fails (the error on stderr); 2 on bad arguments.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/refitctl.h"
#include "daemon/common/grpc_status.h"
#include "google/protobuf/util/json_util.h"
#include "refit/v1/control.grpc.pb.h"

namespace {

namespace v1 = refit::v1;

struct Args {
  std::string publisher, safetensors;
  std::vector<std::string> subscribers;
  uint64_t version = 0;
  double timeout_s = 600;
  bool verify = false;
};

struct Wait {
  grpc::Status status;
  v1::WaitVersionResponse response;
  uint64_t end_unix_ns = 0;
};

uint64_t NowNs() { return static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())); }

std::unique_ptr<v1::Control::Stub> Stub(const std::string& address) {
  refit::client::ControlTarget t;
  t.address = address;
  auto channel = refit::client::MakeControlChannel(t, "control");
  if (!channel.ok()) {
    std::fprintf(stderr, "wan_step: %s: %s\n", address.c_str(),
                 channel.status().ToString().c_str());
    std::exit(1);
  }
  (*channel)->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return v1::Control::NewStub(*channel);
}

void Check(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return;
  std::fprintf(stderr, "wan_step: %s: %s\n", what.c_str(),
               refit::FromGrpcStatus(s).ToString().c_str());
  std::exit(1);
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  if (!google::protobuf::util::MessageToJsonString(m, &out, o).ok()) return "null";
  return out;
}

void SetDeadline(grpc::ClientContext* ctx, double seconds) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has = i + 1 < argc;
    if (k == "--publisher" && has) a.publisher = argv[++i];
    else if (k == "--subscriber" && has) a.subscribers.push_back(argv[++i]);
    else if (k == "--safetensors" && has) a.safetensors = argv[++i];
    else if (k == "--version" && has) a.version = std::strtoull(argv[++i], nullptr, 10);
    else if (k == "--timeout" && has) a.timeout_s = std::atof(argv[++i]);
    else if (k == "--verify") a.verify = true;
    else {
      std::fprintf(stderr, "wan_step: bad argument %s (see the header of wan_step.cc)\n",
                   k.c_str());
      std::exit(2);
    }
  }
  if (a.publisher.empty() || a.subscribers.empty() || a.safetensors.empty() || a.version == 0) {
    std::fprintf(stderr, "wan_step: --publisher, --subscriber, --version and --safetensors are "
                         "required\n");
    std::exit(2);
  }
  return a;
}

std::vector<Wait> PublishAndWait(const Args& a, v1::Control::Stub* pub,
                                 const std::vector<std::unique_ptr<v1::Control::Stub>>& subs,
                                 v1::PublishResponse* resp, uint64_t* t0, uint64_t* t1) {
  std::vector<Wait> waits(subs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < subs.size(); ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, a.timeout_s + 5);
      v1::WaitVersionRequest req;
      req.set_version(a.version);
      req.set_timeout_ms(static_cast<uint64_t>(a.timeout_s * 1000));
      waits[i].status = subs[i]->WaitVersion(&ctx, req, &waits[i].response);
      waits[i].end_unix_ns = NowNs();
    });
  }
  v1::PublishRequest req;
  req.add_safetensors(a.safetensors);
  req.set_version(a.version);
  req.set_request_id(absl::StrCat("wan-", a.version, "-", NowNs()));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, a.timeout_s);
  *t0 = NowNs();
  const grpc::Status s = pub->Publish(&ctx, req, resp);
  *t1 = NowNs();
  for (std::thread& t : threads) t.join();
  Check(s, "publish");
  for (size_t i = 0; i < waits.size(); ++i) Check(waits[i].status, a.subscribers[i] + " wait");
  return waits;
}

v1::StatusResponse Status(v1::Control::Stub* stub, const std::string& who) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, 30);
  v1::StatusResponse r;
  Check(stub->Status(&ctx, v1::StatusRequest(), &r), who + " status");
  return r;
}

std::string Verify(v1::Control::Stub* stub, const std::string& who) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, 600);
  v1::VerifyResponse r;
  Check(stub->Verify(&ctx, v1::VerifyRequest(), &r), who + " verify");
  r.clear_tensors();
  return Json(r);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  auto pub = Stub(a.publisher);
  std::vector<std::unique_ptr<v1::Control::Stub>> subs;
  for (const std::string& s : a.subscribers) subs.push_back(Stub(s));
  v1::PublishResponse resp;
  uint64_t t0 = 0, t1 = 0;
  const std::vector<Wait> waits = PublishAndWait(a, pub.get(), subs, &resp, &t0, &t1);
  std::string out = absl::StrCat("{\"publish_start_unix_ns\": ", t0,
                                 ", \"publish_return_unix_ns\": ", t1, ", \"publish\": ",
                                 Json(resp), ", \"waits\": [");
  for (size_t i = 0; i < waits.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", "{\"end_unix_ns\": ", waits[i].end_unix_ns,
                    ", \"response\": ", Json(waits[i].response), "}");
  }
  absl::StrAppend(&out, "], \"publisher_status\": ", Json(Status(pub.get(), "publisher")),
                  ", \"subscriber_status\": [");
  for (size_t i = 0; i < subs.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", Json(Status(subs[i].get(), a.subscribers[i])));
  }
  absl::StrAppend(&out, "], \"verify\": [");
  for (size_t i = 0; a.verify && i < subs.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", Verify(subs[i].get(), a.subscribers[i]));
  }
  absl::StrAppend(&out, "]}\n");
  std::fputs(out.c_str(), stdout);
  return 0;
}

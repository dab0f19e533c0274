// wan_step: the published versions of one bench/wan/run.py refitd run, timed from the inside.
// Connects once to the publisher's and every subscriber's Control (unix sockets work across
// network namespaces), then reads one command per line from stdin,
//   VERSION FILE [verify]
// and for each: makes the version ready to publish (outside the clock), starts a WaitVersion on
// every subscriber, publishes, and prints one JSON line:
//   {"publish_via", "load_ms", "publish_start_unix_ns", "publish_return_unix_ns",
//    "publish": PublishResponse (control) | LocalPublishResponse (trainer_api),
//    "waits": [{"end_unix_ns", "response"}...], "publisher_status": StatusResponse,
//    "subscriber_status": [StatusResponse...], "verify": [VerifyResponse without tensors...]}
// (verify only for commands ending in "verify"). Messages are printed with proto field names
// (64-bit integers as JSON strings, as protobuf's JSON mapping does).
//
// Two ways to publish (--publish-via):
//   trainer_api (default): as a trainer does. The tool registers the tensors of the first FILE
//     once, in one memfd, with the publisher's TrainerApi (--trainer-socket; a unix socket, so it
//     crosses network namespaces too); for each command it copies FILE's tensors into that memfd
//     (load_ms, before the clock starts; the previous Publish has returned by then, so the
//     publisher has read the buffers), then the clock covers TrainerApi Publish -> applied.
//     Every FILE must hold the first one's tensors (names and sizes, in order).
//   control: Control Publish of FILE (the publisher reads and parses the file inside the call;
//     FILE must lie beneath its files.publish_dirs). load_ms is 0.
//   wan_step --publisher ADDR --subscriber ADDR [--subscriber ADDR]...
//            [--publish-via trainer_api|control] [--trainer-socket PATH] [--timeout S]
// Exit 0 at the end of stdin; 1 when a call fails (the error on stderr); 2 on bad arguments.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/refitctl.h"
#include "client/trainer_client.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors.h"
#include "daemon/sync/version_digest.h"
#include "google/protobuf/util/json_util.h"
#include "refit/v1/control.grpc.pb.h"

namespace {

namespace v1 = refit::v1;

struct Args {
  std::string publisher, via = "trainer_api", trainer_socket;
  std::vector<std::string> subscribers;
  double timeout_s = 600;
};

struct Command {
  uint64_t version = 0;
  std::string file;
  bool verify = false;
};

struct Wait {
  grpc::Status status;
  v1::WaitVersionResponse response;
  uint64_t end_unix_ns = 0;
};

// One publish call: its status, response (as JSON) and clock.
struct Published {
  absl::Status status;
  std::string json = "null";
  uint64_t t0 = 0, t1 = 0;
};

uint64_t NowNs() { return static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())); }

[[noreturn]] void Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "wan_step: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

void Check(const grpc::Status& s, const std::string& what) {
  if (!s.ok()) Fail(what, refit::FromGrpcStatus(s));
}

std::unique_ptr<v1::Control::Stub> Stub(const std::string& address) {
  refit::client::ControlTarget t;
  t.address = address;
  auto channel = refit::client::MakeControlChannel(t, "control");
  if (!channel.ok()) Fail(address, channel.status());
  (*channel)->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return v1::Control::NewStub(*channel);
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

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr, "wan_step: %s (see the header of wan_step.cc)\n", why.c_str());
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has = i + 1 < argc;
    if (k == "--publisher" && has) a.publisher = argv[++i];
    else if (k == "--subscriber" && has) a.subscribers.push_back(argv[++i]);
    else if (k == "--publish-via" && has) a.via = argv[++i];
    else if (k == "--trainer-socket" && has) a.trainer_socket = argv[++i];
    else if (k == "--timeout" && has) a.timeout_s = std::atof(argv[++i]);
    else Usage(absl::StrCat("bad argument ", k));
  }
  if (a.publisher.empty() || a.subscribers.empty()) {
    Usage("--publisher and --subscriber are required");
  }
  if (a.via != "trainer_api" && a.via != "control") {
    Usage(absl::StrCat("--publish-via ", a.via, ": trainer_api or control"));
  }
  if (a.via == "trainer_api" && a.trainer_socket.empty()) {
    Usage("--publish-via trainer_api needs --trainer-socket (the publisher's local_socket)");
  }
  return a;
}

// "VERSION FILE [verify]"; false at the end of stdin. A malformed line exits 2.
bool ReadCommand(Command* c) {
  std::string line;
  if (!std::getline(std::cin, line)) return false;
  std::istringstream in(line);
  std::string verify;
  if (!(in >> c->version >> c->file) || c->version == 0) {
    Usage(absl::StrCat("stdin: expected \"VERSION FILE [verify]\", got \"", line, "\""));
  }
  in >> verify;
  c->verify = verify == "verify";
  return true;
}

// The trainer's side of the TrainerApi path: one memfd registered at the first file.
class Trainer {
 public:
  explicit Trainer(std::string socket) : socket_(std::move(socket)) {}

  // Copies `file`'s tensors into the memfd (creating and registering it on the first call).
  absl::Status Load(const std::string& file) {
    ASSIGN_OR_RETURN(refit::model::SafetensorsFile f, refit::model::SafetensorsFile::Open(file));
    if (client_ == nullptr) RETURN_IF_ERROR(Register(f));
    if (f.tensors().size() != client_->num_tensors()) {
      return absl::FailedPreconditionError(
          absl::StrCat(file, " holds ", f.tensors().size(), " tensors; the registered memfd ",
                       client_->num_tensors()));
    }
    for (size_t i = 0; i < f.tensors().size(); ++i) {
      const std::span<uint8_t> dst = client_->tensor(i);
      if (f.tensors()[i].name != client_->spec(i).name() || f.data(i).size() != dst.size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            file, ": tensor ", i, " \"", f.tensors()[i].name, "\" (", f.data(i).size(),
            " bytes) is not the registered \"", client_->spec(i).name(), "\" (", dst.size(),
            " bytes)"));
      }
      std::memcpy(dst.data(), f.data(i).data(), dst.size());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<v1::LocalPublishResponse> Publish(uint64_t version) {
    return client_->Publish(version);
  }

 private:
  absl::Status Register(const refit::model::SafetensorsFile& f) {
    std::vector<v1::TensorSpec> specs;
    for (const refit::model::SafetensorsEntry& e : f.tensors()) {
      v1::TensorSpec s;
      s.set_name(e.name);
      s.set_dtype(refit::sync::ToProtoDType(e.dtype));
      for (int64_t d : e.shape) s.add_shape(static_cast<uint64_t>(d));
      specs.push_back(std::move(s));
    }
    ASSIGN_OR_RETURN(client_, refit::client::TrainerClient::Create(socket_, "wan-trainer", specs));
    return client_->Register().status();
  }

  std::string socket_;
  std::unique_ptr<refit::client::TrainerClient> client_;
};

Published ControlPublish(const Args& a, const Command& c, v1::Control::Stub* pub) {
  v1::PublishRequest req;
  req.add_safetensors(c.file);
  req.set_version(c.version);
  req.set_request_id(absl::StrCat("wan-", c.version, "-", NowNs()));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, a.timeout_s);
  v1::PublishResponse resp;
  Published p;
  p.t0 = NowNs();
  const grpc::Status s = pub->Publish(&ctx, req, &resp);
  p.t1 = NowNs();
  p.status = refit::FromGrpcStatus(s);
  if (p.status.ok()) p.json = Json(resp);
  return p;
}

Published TrainerPublish(const Command& c, Trainer* trainer) {
  Published p;
  p.t0 = NowNs();
  absl::StatusOr<v1::LocalPublishResponse> r = trainer->Publish(c.version);
  p.t1 = NowNs();
  p.status = r.status();
  if (r.ok() && (!r->committed() || r->version() != c.version)) {
    p.status = absl::InternalError(absl::StrCat("TrainerApi Publish of version ", c.version,
                                                " answered version ", r->version(), ", committed ",
                                                r->committed() ? "true" : "false"));
  }
  if (p.status.ok()) p.json = Json(*r);
  return p;
}

// Starts a WaitVersion on every subscriber, then `publish`, and waits for all of them.
std::vector<Wait> PublishAndWait(const Args& a, uint64_t version,
                                 const std::vector<std::unique_ptr<v1::Control::Stub>>& subs,
                                 const std::function<Published()>& publish, Published* p) {
  std::vector<Wait> waits(subs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < subs.size(); ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, a.timeout_s + 5);
      v1::WaitVersionRequest req;
      req.set_version(version);
      req.set_timeout_ms(static_cast<uint64_t>(a.timeout_s * 1000));
      waits[i].status = subs[i]->WaitVersion(&ctx, req, &waits[i].response);
      waits[i].end_unix_ns = NowNs();
    });
  }
  *p = publish();
  for (std::thread& t : threads) t.join();
  if (!p->status.ok()) Fail(absl::StrCat("publish (", a.via, ") of version ", version), p->status);
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

std::string Report(const Args& a, const Command& c, double load_ms, const Published& p,
                   const std::vector<Wait>& waits, v1::Control::Stub* pub,
                   const std::vector<std::unique_ptr<v1::Control::Stub>>& subs) {
  std::string out = absl::StrCat("{\"publish_via\": \"", a.via, "\", \"load_ms\": ", load_ms,
                                 ", \"publish_start_unix_ns\": ", p.t0,
                                 ", \"publish_return_unix_ns\": ", p.t1, ", \"publish\": ", p.json,
                                 ", \"waits\": [");
  for (size_t i = 0; i < waits.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", "{\"end_unix_ns\": ", waits[i].end_unix_ns,
                    ", \"response\": ", Json(waits[i].response), "}");
  }
  absl::StrAppend(&out, "], \"publisher_status\": ", Json(Status(pub, "publisher")),
                  ", \"subscriber_status\": [");
  for (size_t i = 0; i < subs.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", Json(Status(subs[i].get(), a.subscribers[i])));
  }
  absl::StrAppend(&out, "], \"verify\": [");
  for (size_t i = 0; c.verify && i < subs.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", Verify(subs[i].get(), a.subscribers[i]));
  }
  absl::StrAppend(&out, "]}\n");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  auto pub = Stub(a.publisher);
  std::vector<std::unique_ptr<v1::Control::Stub>> subs;
  for (const std::string& s : a.subscribers) subs.push_back(Stub(s));
  Trainer trainer(a.trainer_socket);
  Command c;
  while (ReadCommand(&c)) {
    double load_ms = 0;
    std::function<Published()> publish = [&] { return ControlPublish(a, c, pub.get()); };
    if (a.via == "trainer_api") {
      const auto l0 = std::chrono::steady_clock::now();
      if (absl::Status s = trainer.Load(c.file); !s.ok()) Fail("loading the memfd", s);
      load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - l0)
                    .count();
      publish = [&] { return TrainerPublish(c, &trainer); };
    }
    Published p;
    const std::vector<Wait> waits = PublishAndWait(a, c.version, subs, publish, &p);
    const std::string out = Report(a, c, load_ms, p, waits, pub.get(), subs);
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }
  return 0;
}

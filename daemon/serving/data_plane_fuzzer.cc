// libFuzzer target for DataPlaneService (data_plane_service.h): one subscriber's Sync session
// per input, its messages (Hello, Ack, KeyframeRequest, empty or raw SubscriberMessages, Stripe
// calls, half-close) decoded from the input with a FuzzedDataProvider (language:
// data_plane_fuzz_input.h) and sent over a real gRPC server's in-process channel to the service
// around a PublisherCore that has published versions 1..3 of a small model.
//
// Findings: crashes and sanitizer reports, and these invariants (abort()):
//   - the publisher's side of the protocol (data.proto): Welcome first and once, granting at
//     most the stripes and frame size asked for; frames only inside a transfer, of its version
//     and at most Welcome.frame_bytes; VersionEnd of the open transfer; no VersionHeader after a
//     VersionEnd until the subscriber has sent an Ack;
//   - every session ends: once the client has cancelled, the service lists no live session
//     within 10 s (a handler that never returns would hold a server thread forever).
// Build: cmake -DREFIT_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ ...; run: data_plane_fuzzer DIR
// (make_data_plane_corpus DIR writes seeds: sessions that bootstrap, apply, reject, ask for
// keyframes, use stripes).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/logging.h"
#include "daemon/serving/data_plane_fuzz_input.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_testing.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "refit/v1/data.grpc.pb.h"

namespace refit::publisher::fuzz {
namespace {

// REFIT_FUZZ_TRACE=1 prints every message sent and received (for reading a finding or a seed).
const bool kTrace = std::getenv("REFIT_FUZZ_TRACE") != nullptr;

void Trace(const char* dir, const google::protobuf::Message& m) {
  if (kTrace) std::fprintf(stderr, "%s %s\n", dir, m.ShortDebugString().substr(0, 300).c_str());
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "data_plane_fuzzer invariant violated: %s\n", what.c_str());
  std::abort();
}

const char* const kTensors[] = {"a.weight", "b.bias", "scale", "c.extra"};

// The server, made once and never destroyed (libFuzzer exits without unwinding).
struct Server {
  std::unique_ptr<testing::ModelPublisher> model;
  std::vector<uint64_t> digests{0};  // digests[v] of version v
  std::vector<std::vector<v1::TensorDigest>> tensors{{}};
  std::unique_ptr<DataPlaneService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::DataPlane::Stub> stub;
};

Server& GetServer() {
  static Server* s = [] {
    SetLogLevel(kTrace ? spdlog::level::debug : spdlog::level::off);
    google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in fuzzed names is expected
    auto* s = new Server;
    using sync::testing::BF16;
    s->model = std::make_unique<testing::ModelPublisher>(
        std::vector<v1::TensorSpec>{BF16(kTensors[0], {40, 100}), BF16(kTensors[1], {300}),
                                    BF16(kTensors[2], {4})},
        /*seed=*/7, /*change=*/0.01);
    for (int v = 1; v <= 3; ++v) {
      s->model->PublishNext(v == 3 ? std::optional(BF16(kTensors[3], {50})) : std::nullopt);
      s->digests.push_back(s->model->digest());
      std::vector<v1::TensorDigest> td;
      for (const BaselineTensor& t : s->model->core().Baseline()) {
        v1::TensorDigest d;
        d.set_name(t.spec.name());
        d.set_digest(t.digest);
        td.push_back(d);
      }
      s->tensors.push_back(td);
    }
    if (s->model->core().newest_version() != 3) Fail("the model did not publish");
    DataPlaneOptions o;
    o.name = "fuzz-publisher";
    o.frame_bytes = 64 * 1024;
    o.max_streams_per_subscriber = 4;
    o.stripe_join_timeout = absl::Milliseconds(100);
    o.retry_initial = absl::Milliseconds(1);
    o.retry_max = absl::Milliseconds(4);
    s->service = std::make_unique<DataPlaneService>(&s->model->core(), o);
    grpc::ServerBuilder builder;
    builder.RegisterService(s->service.get());
    s->server = builder.BuildAndStart();
    if (s->server == nullptr) Fail("the server did not start");
    s->stub = v1::DataPlane::NewStub(s->server->InProcessChannel(grpc::ChannelArguments()));
    return s;
  }();
  return *s;
}

// What the client has seen and sent, checked against the protocol as messages arrive.
class Protocol {
 public:
  void Sent(const v1::SubscriberMessage& m) {
    absl::MutexLock lock(&mu_);
    if (m.has_hello() && !hello_) {
      hello_ = true;
      asked_stripes_ = m.hello().stripes();
      asked_frame_bytes_ = m.hello().max_frame_bytes();
    }
    if (m.has_ack()) ++acks_;
  }

  void Received(const v1::PublisherMessage& m) {
    absl::MutexLock lock(&mu_);
    if (!welcome_.has_value()) {
      if (!m.has_welcome()) Fail("the first PublisherMessage is not Welcome");
      if (!hello_) Fail("Welcome before Hello");
      welcome_ = m.welcome();
      if (welcome_->stripes() > asked_stripes_) Fail("more stripes granted than asked for");
      if (welcome_->frame_bytes() > asked_frame_bytes_) Fail("frames above max_frame_bytes");
      return;
    }
    switch (m.msg_case()) {
      case v1::PublisherMessage::kWelcome: Fail("a second Welcome");
      case v1::PublisherMessage::kHeader:
        // Each ended transfer takes one Ack before the next header (an Ack may be sent
        // early, even before its header arrives, and still count for it).
        if (open_) Fail("a VersionHeader inside a transfer");
        if (acks_ < ends_) Fail("a VersionHeader before the previous transfer's Ack");
        open_ = true;
        header_ = m.header();
        return;
      case v1::PublisherMessage::kFrame:
        if (!open_) Fail("a DataFrame outside a transfer");
        if (m.frame().version() != header_.version()) Fail("a DataFrame of another version");
        CheckFrameLocked(m.frame());
        return;
      case v1::PublisherMessage::kEnd:
        if (!open_ || m.end().version() != header_.version()) Fail("VersionEnd of no transfer");
        open_ = false;
        ++ends_;
        end_ = m.end();
        return;
      case v1::PublisherMessage::kAbort:
        open_ = false;
        return;
      default: Fail("an empty PublisherMessage");
    }
  }

  void StripeFrame(const v1::DataFrame& f) {
    absl::MutexLock lock(&mu_);
    CheckFrameLocked(f);
  }

  uint64_t session_id() const {
    absl::MutexLock lock(&mu_);
    return welcome_.has_value() ? welcome_->session_id() : 0;
  }
  v1::VersionHeader header() const {
    absl::MutexLock lock(&mu_);
    return header_;
  }
  v1::VersionEnd end() const {
    absl::MutexLock lock(&mu_);
    return end_;
  }

 private:
  void CheckFrameLocked(const v1::DataFrame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!welcome_.has_value() || f.payload().size() > welcome_->frame_bytes()) {
      Fail("a DataFrame payload above Welcome.frame_bytes");
    }
  }

  mutable absl::Mutex mu_;
  bool hello_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t asked_stripes_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t asked_frame_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<v1::Welcome> welcome_ ABSL_GUARDED_BY(mu_);
  bool open_ ABSL_GUARDED_BY(mu_) = false;  // header seen, end not yet
  uint64_t ends_ ABSL_GUARDED_BY(mu_) = 0;  // VersionEnds received
  uint64_t acks_ ABSL_GUARDED_BY(mu_) = 0;  // Acks sent
  v1::VersionHeader header_ ABSL_GUARDED_BY(mu_);
  v1::VersionEnd end_ ABSL_GUARDED_BY(mu_);
};

std::string PickTensor(FuzzedDataProvider& in) {
  const int i = in.ConsumeIntegralInRange<int>(0, 4);
  return i < 4 ? kTensors[i] : in.ConsumeRandomLengthString(kMaxStringBytes);
}

void AddTensors(FuzzedDataProvider& in, google::protobuf::RepeatedPtrField<std::string>* out) {
  for (int n = in.ConsumeIntegralInRange<int>(0, 2); n > 0; --n) *out->Add() = PickTensor(in);
}

v1::SubscriberMessage MakeHello(FuzzedDataProvider& in, const Server& s) {
  v1::SubscriberMessage m;
  v1::Hello* h = m.mutable_hello();
  h->set_protocol(static_cast<v1::ProtocolVersion>(in.ConsumeIntegralInRange<int>(0, 2)));
  h->set_name(in.ConsumeRandomLengthString(kMaxStringBytes));
  const int v = in.ConsumeIntegralInRange<int>(0, 4);
  h->set_version(v < 4 ? v : in.ConsumeIntegral<uint64_t>());
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: h->set_version_digest(v < 4 ? s.digests[v] : 0); break;
    case 1: h->set_version_digest(0); break;
    default: h->set_version_digest(in.ConsumeIntegral<uint64_t>()); break;
  }
  if (in.ConsumeBool() && v < 4) {
    for (const v1::TensorDigest& t : s.tensors[v]) *h->add_tensors() = t;
  }
  h->set_stripes(in.ConsumeIntegralInRange<uint32_t>(0, 3));
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: h->set_max_frame_bytes(64 * 1024); break;
    case 1: h->set_max_frame_bytes(1 << 20); break;
    default: h->set_max_frame_bytes(in.ConsumeIntegral<uint32_t>()); break;
  }
  if (in.ConsumeBool()) h->add_patch_formats(1);
  if (in.ConsumeBool()) h->add_compressions(v1::COMPRESSION_LZ4);
  h->set_want_keyframe(in.ConsumeBool());
  return m;
}

v1::SubscriberMessage MakeAck(FuzzedDataProvider& in, const Protocol& p) {
  const v1::VersionHeader header = p.header();
  const v1::VersionEnd end = p.end();
  v1::SubscriberMessage m;
  v1::Ack* a = m.mutable_ack();
  a->set_version(in.ConsumeIntegralInRange<int>(0, 1) == 0 ? header.version()
                                                           : in.ConsumeIntegral<uint64_t>());
  a->set_result(static_cast<v1::AckResult>(in.ConsumeIntegralInRange<int>(0, 3)));
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: a->set_applied_version(header.version()); break;
    case 1: a->set_applied_version(header.base_version()); break;
    default: a->set_applied_version(in.ConsumeIntegral<uint64_t>()); break;
  }
  a->set_applied_version_digest(in.ConsumeIntegralInRange<int>(0, 1) == 0
                                    ? end.version_digest()
                                    : in.ConsumeIntegral<uint64_t>());
  AddTensors(in, a->mutable_mismatched_tensors());
  return m;
}

v1::SubscriberMessage MakeKeyframeRequest(FuzzedDataProvider& in) {
  v1::SubscriberMessage m;
  v1::KeyframeRequest* k = m.mutable_keyframe_request();
  k->set_version(in.ConsumeIntegral<uint64_t>());
  AddTensors(in, k->mutable_tensors());
  k->set_all_tensors(in.ConsumeBool());
  k->set_reason(in.ConsumeRandomLengthString(kMaxStringBytes));
  return m;
}

// One Sync session and its stripes.
class Session {
 public:
  explicit Session(Server& s) : server_(s) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    stream_ = server_.stub->Sync(&context_);
    reader_ = std::thread([this] { ReadSync(); });
  }

  void Step(FuzzedDataProvider& in) {
    switch (in.ConsumeIntegralInRange<uint8_t>(0, kOpCount - 1)) {
      case kHello: Send(MakeHello(in, server_)); break;
      case kAck: Send(MakeAck(in, protocol_)); break;
      case kKeyframeRequest: Send(MakeKeyframeRequest(in)); break;
      case kEmpty: Send(v1::SubscriberMessage()); break;
      case kWait: Wait(static_cast<WaitFor>(in.ConsumeIntegralInRange<uint8_t>(0, kWaitForCount - 1))); break;
      case kStripe: {
        v1::StripeRequest r;
        r.set_session_id(in.ConsumeIntegralInRange<int>(0, 1) == 0 ? protocol_.session_id()
                                                                   : in.ConsumeIntegral<uint64_t>());
        r.set_stripe_index(in.ConsumeIntegralInRange<uint32_t>(0, 4));
        StartStripe(r);
        break;
      }
      case kWritesDone:
        if (!writes_done_) stream_->WritesDone();
        writes_done_ = true;
        break;
      case kResync: {
        const bool all = in.ConsumeBool();
        google::protobuf::RepeatedPtrField<std::string> tensors;
        AddTensors(in, &tensors);
        server_.service->RequestResync(all ? "" : "fuzz-subscriber",
                                       {tensors.begin(), tensors.end()});
        break;
      }
      case kRaw: {
        const uint16_t n = in.ConsumeIntegralInRange<uint16_t>(0, kMaxRawBytes);
        const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(n);
        v1::SubscriberMessage m;
        if (m.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) Send(m);
        break;
      }
      default: break;
    }
  }

  // Cancels everything and checks that the service lets go of the session.
  void Finish() {
    if (!writes_done_) stream_->WritesDone();
    context_.TryCancel();
    reader_.join();
    const grpc::Status st = stream_->Finish();
    if (kTrace) std::fprintf(stderr, "finished: %d %s\n", st.error_code(), st.error_message().c_str());
    for (auto& stripe : stripes_) {
      stripe->context.TryCancel();
      stripe->thread.join();
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!server_.service->Sessions().empty()) {
      if (absl::Now() > deadline) Fail("a session outlived its cancelled Sync call by 10 s");
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

 private:
  struct Stripe {
    grpc::ClientContext context;
    std::thread thread;
  };

  void Send(const v1::SubscriberMessage& m) {
    if (writes_done_) return;
    protocol_.Sent(m);
    Trace("sent", m);
    (void)stream_->Write(m);  // false once the server has finished the call: fine
  }

  void ReadSync() {
    v1::PublisherMessage m;
    while (stream_->Read(&m)) {
      if (!m.has_frame()) Trace("received", m);
      protocol_.Received(m);
      absl::MutexLock lock(&mu_);
      ++messages_;
      if (m.has_end()) ++ends_;
    }
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

  void Wait(WaitFor what) {
    absl::MutexLock lock(&mu_);
    const uint64_t messages = messages_, ends = ends_;
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (closed_) return true;
      if (what == kWaitMessage) return messages_ > messages;
      if (what == kWaitEnd) return ends_ > ends;
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(kWaitMillis));
  }

  void StartStripe(const v1::StripeRequest& r) {
    if (stripes_.size() >= 4) return;
    auto stripe = std::make_unique<Stripe>();
    stripe->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    Stripe* st = stripe.get();
    stripe->thread = std::thread([this, st, r] {
      auto reader = server_.stub->Stripe(&st->context, r);
      v1::DataFrame f;
      while (reader->Read(&f)) protocol_.StripeFrame(f);
      (void)reader->Finish();
    });
    stripes_.push_back(std::move(stripe));
  }

  Server& server_;
  Protocol protocol_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SubscriberMessage, v1::PublisherMessage>> stream_;
  std::thread reader_;
  bool writes_done_ = false;
  std::vector<std::unique_ptr<Stripe>> stripes_;
  absl::Mutex mu_;
  uint64_t messages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ends_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace
}  // namespace refit::publisher::fuzz

// LeakSanitizer (libFuzzer's per-input leak check) once took two of the gRPC sync server's
// worker threads, which it starts and stops on demand, for leaks (not reproducible: a thread
// object in the middle of being handed over between gRPC's threads). Not refitd memory; only
// those two gRPC allocation sites are ignored.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:grpc::ThreadManager::MainWorkLoop\nleak:grpc_core::Thread::Thread\n";
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace refit::publisher::fuzz;
  FuzzedDataProvider in(data, size);
  Session session(GetServer());
  for (int ops = 0; ops < 32 && in.remaining_bytes() > 0; ++ops) session.Step(in);
  session.Finish();
  return 0;
}

// Acceptance 6: clear errors on bad input, never a crash or a silent skip.
//  - A raw DataPlane client sending malformed messages to a real publisher gets a gRPC error that
//    names the problem, while the publisher keeps serving a real subscriber.
//  - Malformed Control / ConsumerApi requests get clear errors.
//  - A fake publisher (a DataPlane server in this test) sends a real subscriber broken transfers:
//    bad checksum, wrong version, wrong digest, unknown tensor index, wrong-size tensor. The
//    subscriber rejects each (Ack REJECTED or ends the session naming it), keeps its version, and
//    still applies a good transfer afterwards.
//  - Bad configs and command lines of refitd and refitctl: one line naming the problem, exit 2.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <limits>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/codec/codec.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/codec/patch_testing.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/version_digest.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/data.grpc.pb.h"
#include "refit/v1/local.grpc.pb.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::Not;

bool ContainsAny(const std::string& text, const std::vector<std::string>& needles) {
  const std::string lower = absl::AsciiStrToLower(text);
  for (const std::string& n : needles) {
    if (absl::StrContains(lower, absl::AsciiStrToLower(n))) return true;
  }
  return false;
}

std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) absl::StrAppend(&s, s.empty() ? "" : " | ", x);
  return s;
}

v1::Hello GoodHello(const std::string& name) {
  v1::Hello h;
  h.set_protocol(v1::PROTOCOL_VERSION_1);
  h.set_name(name);
  h.set_max_frame_bytes(4 << 20);
  h.add_patch_formats(1);
  h.add_compressions(v1::COMPRESSION_LZ4);
  return h;
}

// ---- raw DataPlane client against a real publisher ------------------------------------------------

class E2EBadInput : public E2ETest {
 protected:
  // Sends `msgs` on a Sync stream, drains what the publisher sends until it ends the call, and
  // returns its final status (DEADLINE_EXCEEDED when it never does).
  grpc::Status RunSync(const std::string& target, const std::vector<v1::SubscriberMessage>& msgs) {
    auto stub = v1::DataPlane::NewStub(PlainChannel(target));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    auto stream = stub->Sync(&ctx);
    for (const v1::SubscriberMessage& m : msgs) {
      if (!stream->Write(m)) break;
    }
    v1::PublisherMessage in;
    while (stream->Read(&in)) {
    }
    return stream->Finish();
  }
};

struct SyncCase {
  std::string what;
  std::vector<v1::SubscriberMessage> msgs;
  std::vector<grpc::StatusCode> codes;  // any of
  std::vector<std::string> words;       // the message names one of these
};

TEST_F(E2EBadInput, PublisherRejectsMalformedDataPlaneMessagesAndKeepsServing) {
  absl::StatusOr<PubSub> daemons = StartPubSub("honest");
  E2E_ASSERT_OK(daemons);
  DaemonProcess& pub = *daemons->pub;
  DaemonProcess& sub = *daemons->sub;
  Model m1 = RandomModel(1, {{"w.a", 50000}, {"w.b", 7000}});
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  E2E_ASSERT_OK(WaitVersion(sub, 1));

  auto hello = [](v1::Hello h) {
    v1::SubscriberMessage m;
    *m.mutable_hello() = std::move(h);
    return m;
  };
  auto ack = [](uint64_t v) {
    v1::SubscriberMessage m;
    m.mutable_ack()->set_version(v);
    m.mutable_ack()->set_result(v1::ACK_RESULT_APPLIED);
    m.mutable_ack()->set_applied_version(v);
    return m;
  };
  auto keyframe_req = [](const std::vector<std::string>& tensors) {
    v1::SubscriberMessage m;
    v1::KeyframeRequest* req = m.mutable_keyframe_request();
    for (const std::string& t : tensors) req->add_tensors(t);
    return m;
  };
  v1::Hello bad_protocol = GoodHello("raw");
  bad_protocol.set_protocol(v1::PROTOCOL_VERSION_UNSPECIFIED);
  v1::Hello future_protocol = GoodHello("raw");
  future_protocol.set_protocol(static_cast<v1::ProtocolVersion>(7));
  v1::Hello no_formats = GoodHello("raw");
  no_formats.clear_patch_formats();
  using C = grpc::StatusCode;
  const std::vector<SyncCase> cases = {
      {"Ack before Hello", {ack(1)}, {C::INVALID_ARGUMENT, C::FAILED_PRECONDITION}, {"Hello"}},
      {"Hello with protocol 0", {hello(bad_protocol)}, {C::FAILED_PRECONDITION}, {"protocol"}},
      {"Hello with protocol 7", {hello(future_protocol)}, {C::FAILED_PRECONDITION}, {"protocol"}},
      {"Hello without patch format 1", {hello(no_formats)}, {C::FAILED_PRECONDITION, C::INVALID_ARGUMENT},
       {"patch_format", "format"}},
      {"Ack for a version never sent", {hello(GoodHello("raw")), ack(999)},
       {C::FAILED_PRECONDITION, C::INVALID_ARGUMENT}, {"999"}},
      {"KeyframeRequest naming no tensor", {hello(GoodHello("raw")), keyframe_req({})},
       {C::INVALID_ARGUMENT}, {"KeyframeRequest"}},
      {"KeyframeRequest naming an unknown tensor",
       {hello(GoodHello("raw")), keyframe_req({"no.such.tensor"})},
       {C::INVALID_ARGUMENT, C::NOT_FOUND}, {"no.such.tensor"}},
      {"Hello twice", {hello(GoodHello("raw")), hello(GoodHello("raw"))},
       {C::INVALID_ARGUMENT, C::FAILED_PRECONDITION}, {"Hello"}},
  };
  for (const SyncCase& c : cases) {
    const grpc::Status st = RunSync(pub.listen_target(), c.msgs);
    std::printf("[e2e] %s -> %d: %s\n", c.what.c_str(), static_cast<int>(st.error_code()),
                st.error_message().c_str());
    EXPECT_THAT(st, Not(IsOk())) << c.what << ": the publisher accepted it";
    EXPECT_TRUE(std::find(c.codes.begin(), c.codes.end(), st.error_code()) != c.codes.end())
        << c.what << ": code " << st.error_code() << " (" << st.error_message() << ")";
    EXPECT_TRUE(ContainsAny(st.error_message(), c.words))
        << c.what << ": message '" << st.error_message() << "' names none of " << Join(c.words);
  }
  // A Stripe for a session that does not exist.
  {
    auto stub = v1::DataPlane::NewStub(PlainChannel(pub.listen_target()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::StripeRequest req;
    req.set_session_id(0x1234567890ABCDEFull);
    req.set_stripe_index(1);
    auto reader = stub->Stripe(&ctx, req);
    v1::DataFrame f;
    while (reader->Read(&f)) {
    }
    const grpc::Status st = reader->Finish();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kNotFound));
    EXPECT_TRUE(ContainsAny(st.error_message(), {"session"})) << st.error_message();
  }

  // The publisher still serves its real subscriber.
  Model m2 = m1;
  PerturbModel(m2, 0.02, 2);
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m2));
  ASSERT_TRUE(pub.running()) << pub.LogTail();
}

// ---- malformed Control / ConsumerApi requests -------------------------------------------------------

struct RpcCase {
  std::string what;
  absl::Status status;
  std::vector<absl::StatusCode> codes;
  std::vector<std::string> words;
};

TEST_F(E2EBadInput, ControlAndConsumerApiRejectMalformedRequests) {
  absl::StatusOr<PubSub> daemons = StartPubSub("sub");
  E2E_ASSERT_OK(daemons);
  DaemonProcess& pub = *daemons->pub;
  DaemonProcess& sub = *daemons->sub;
  Model m1 = RandomModel(5, {{"x", 10000}});
  E2E_ASSERT_OK(Publish(pub, m1, 1));
  E2E_ASSERT_OK(WaitVersion(sub, 1));

  auto sub_control = v1::Control::NewStub(PlainChannel(sub.control_target()));
  auto pub_control = v1::Control::NewStub(PlainChannel(pub.control_target()));
  auto consumer = v1::ConsumerApi::NewStub(PlainChannel(sub.local_target()));
  auto call = [](auto&& fn) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    return FromGrpcStatus(fn(&ctx));
  };
  std::vector<RpcCase> cases;
  using K = absl::StatusCode;
  {
    v1::ExportRequest req;
    req.set_safetensors("../escape.safetensors");
    v1::ExportResponse resp;
    cases.push_back({"subscriber Export out of its export_dir by ..",
                     call([&](grpc::ClientContext* c) { return sub_control->Export(c, req, &resp); }),
                     {K::kInvalidArgument}, {"escape.safetensors", "\"..\" component"}});
  }
  {
    v1::ExportRequest req;
    req.set_safetensors(DefaultExportDir(dir()) + "/never.safetensors");
    req.set_version(99);
    v1::ExportResponse resp;
    cases.push_back({"subscriber Export of a version it does not hold",
                     call([&](grpc::ClientContext* c) { return sub_control->Export(c, req, &resp); }),
                     {K::kFailedPrecondition, K::kNotFound}, {"99"}});
  }
  {
    v1::WaitVersionRequest req;
    req.set_version(99);
    req.set_timeout_ms(300);
    v1::WaitVersionResponse resp;
    cases.push_back({"subscriber WaitVersion that times out",
                     call([&](grpc::ClientContext* c) { return sub_control->WaitVersion(c, req, &resp); }),
                     {K::kDeadlineExceeded}, {"99"}});
  }
  {
    v1::PublishRequest req;
    req.add_safetensors(Path("x.safetensors"));
    v1::PublishResponse resp;
    cases.push_back({"Publish on a subscriber",
                     call([&](grpc::ClientContext* c) { return sub_control->Publish(c, req, &resp); }),
                     {K::kFailedPrecondition}, {"subscriber"}});
  }
  {
    v1::PublishRequest req;
    v1::PublishResponse resp;
    cases.push_back({"Publish without files",
                     call([&](grpc::ClientContext* c) { return pub_control->Publish(c, req, &resp); }),
                     {K::kInvalidArgument}, {"safetensors"}});
  }
  {
    v1::PublishRequest req;
    req.add_safetensors(Path("does-not-exist.safetensors"));
    v1::PublishResponse resp;
    cases.push_back({"Publish of a missing file",
                     call([&](grpc::ClientContext* c) { return pub_control->Publish(c, req, &resp); }),
                     {K::kNotFound, K::kInvalidArgument, K::kFailedPrecondition},
                     {"does-not-exist.safetensors"}});
  }
  {
    REFIT_ASSERT_OK_AND_ASSIGN(std::string path, WriteModelFile(m1, "again"));
    v1::PublishRequest req;
    req.add_safetensors(path);
    req.set_version(1);
    v1::PublishResponse resp;
    cases.push_back({"Publish of a version that is not above the newest",
                     call([&](grpc::ClientContext* c) { return pub_control->Publish(c, req, &resp); }),
                     {K::kFailedPrecondition}, {"version"}});
  }
  {
    absl::StatusOr<std::string> path = WriteModelFile(m1, "relative-publish");
    ASSERT_THAT(path, IsOk());
    v1::PublishRequest req;
    req.add_safetensors("relative-publish.safetensors");
    v1::PublishResponse resp;
    cases.push_back({"Publish of a relative path",
                     call([&](grpc::ClientContext* c) { return pub_control->Publish(c, req, &resp); }),
                     {K::kInvalidArgument, K::kNotFound}, {"relative", "absolute", "relative-publish"}});
  }
  {
    v1::ReleaseLeaseRequest req;
    req.set_lease_id(0xDEADBEEFull);
    v1::ReleaseLeaseResponse resp;
    cases.push_back({"ReleaseLease of an unknown lease",
                     call([&](grpc::ClientContext* c) { return consumer->ReleaseLease(c, req, &resp); }),
                     {K::kNotFound}, {"lease"}});
  }
  {
    v1::RenewLeaseRequest req;
    req.set_lease_id(0xDEADBEEFull);
    v1::Lease resp;
    cases.push_back({"RenewLease of an unknown lease",
                     call([&](grpc::ClientContext* c) { return consumer->RenewLease(c, req, &resp); }),
                     {K::kNotFound}, {"lease"}});
  }
  {
    v1::AcquireLeaseRequest req;
    req.set_consumer("e2e");
    req.set_version(99);
    v1::Lease resp;
    cases.push_back({"AcquireLease of a version not held",
                     call([&](grpc::ClientContext* c) { return consumer->AcquireLease(c, req, &resp); }),
                     {K::kFailedPrecondition, K::kNotFound}, {"99"}});
  }
  {
    v1::GetLayoutRequest req;
    req.set_version(99);
    v1::Layout resp;
    cases.push_back({"GetLayout of a version not held",
                     call([&](grpc::ClientContext* c) { return consumer->GetLayout(c, req, &resp); }),
                     {K::kFailedPrecondition, K::kNotFound}, {"99"}});
  }
  for (const RpcCase& c : cases) {
    std::printf("[e2e] %s -> %s\n", c.what.c_str(), c.status.ToString().c_str());
    EXPECT_THAT(c.status, Not(IsOk())) << c.what << " succeeded";
    EXPECT_TRUE(std::find(c.codes.begin(), c.codes.end(), c.status.code()) != c.codes.end())
        << c.what << ": " << c.status;
    EXPECT_TRUE(ContainsAny(std::string(c.status.message()), c.words))
        << c.what << ": '" << c.status.message() << "' names none of " << Join(c.words);
  }
  // Both daemons still serve.
  Model m2 = m1;
  PerturbModel(m2, 0.05, 9);
  E2E_ASSERT_OK(Publish(pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m2));
}

// ---- a fake publisher sending broken transfers --------------------------------------------------

// One transfer the fake publisher sends: the messages, built for the subscriber's applied version.
struct FakeTransfer {
  std::string what;
  std::function<std::vector<v1::PublisherMessage>(uint64_t applied)> build;
  bool must_apply = false;
  std::vector<std::string> words;  // the rejection names one of these
};

struct FakeOutcome {
  bool acked = false;
  v1::Ack ack;
  bool session_ended = false;
  std::string last_error;  // subscriber's upstream.last_error after the session ended
  uint64_t version_at_reconnect = 0;  // Hello.version of the next session
};

class FakePublisher final : public v1::DataPlane::Service {
 public:
  explicit FakePublisher(std::vector<FakeTransfer> transfers) : transfers_(std::move(transfers)) {}

  void set_subscriber_control(std::string target) {
    std::lock_guard<std::mutex> lock(mu_);
    sub_control_ = std::move(target);
  }
  // Welcome.digest_format of every session (1 = v1, 2 = v2; set before the first session).
  void set_digest_format(uint32_t format) { digest_format_ = format; }
  // Sends transfers [0, n) only, the next once Allow(n + 1) is called (default: all of them), so
  // a test can look at the subscriber between two transfers.
  void Allow(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    allowed_ = n;
    cv_.notify_all();
  }

  grpc::Status Sync(grpc::ServerContext* ctx,
                    grpc::ServerReaderWriter<v1::PublisherMessage, v1::SubscriberMessage>* stream)
      override {
    v1::SubscriberMessage in;
    if (!stream->Read(&in) || !in.has_hello()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "fake: expected Hello");
    }
    uint64_t applied = in.hello().version();
    {
      // A reconnect after a session the subscriber ended: its reason is in Status now (the
      // subscriber clears it only after the next Welcome).
      std::string target;
      int pending = -1;
      {
        std::lock_guard<std::mutex> lock(mu_);
        target = sub_control_;
        pending = awaiting_error_;
        awaiting_error_ = -1;
      }
      if (pending >= 0 && !target.empty()) {
        absl::StatusOr<v1::StatusResponse> st = RpcStatus(target, absl::Seconds(5));
        std::lock_guard<std::mutex> lock(mu_);
        outcomes_[pending].last_error =
            st.ok() ? st->upstream().last_error() : std::string(st.status().message());
        outcomes_[pending].version_at_reconnect = applied;
        cv_.notify_all();
      }
    }
    v1::PublisherMessage welcome;
    v1::Welcome* w = welcome.mutable_welcome();
    w->set_protocol(v1::PROTOCOL_VERSION_1);
    w->set_session_id(0xFA4E000000000000ull + sessions_++);
    w->set_name("fake-publisher");
    w->set_newest_version(2);
    w->set_stripes(0);
    w->set_frame_bytes(kFrameBytes);
    w->set_digest_format(digest_format_);
    if (!stream->Write(welcome)) return grpc::Status::OK;
    for (;;) {
      size_t index;
      {
        std::unique_lock<std::mutex> lock(mu_);
        while (!cv_.wait_for(lock, std::chrono::milliseconds(100),
                             [&] { return next_ < allowed_ || ctx->IsCancelled(); })) {
        }
        index = next_;
        if (index < transfers_.size()) ++next_;
      }
      if (index >= transfers_.size()) {
        // Nothing more to send: hold the session until the subscriber goes away.
        while (stream->Read(&in)) {
        }
        return grpc::Status::OK;
      }
      for (const v1::PublisherMessage& m : transfers_[index].build(applied)) {
        if (!stream->Write(m)) break;
      }
      bool acked = false;
      while (stream->Read(&in)) {
        if (in.has_ack()) {
          acked = true;
          applied = in.ack().applied_version();
          break;
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      FakeOutcome& o = outcomes_[index];
      if (acked) {
        o.acked = true;
        o.ack = in.ack();
      } else {
        o.session_ended = true;
        awaiting_error_ = static_cast<int>(index);
      }
      cv_.notify_all();
      if (!acked) return grpc::Status(grpc::StatusCode::CANCELLED, "fake: subscriber ended the session");
      if (ctx->IsCancelled()) return grpc::Status::OK;
    }
  }

  grpc::Status Stripe(grpc::ServerContext*, const v1::StripeRequest*,
                      grpc::ServerWriter<v1::DataFrame>*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "fake: no stripes granted");
  }

  // Waits until transfer `index` has an outcome (and, for an ended session, the subscriber's
  // error was collected at its reconnect or `error_wait` passed).
  std::optional<FakeOutcome> WaitOutcome(size_t index, absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
    const bool done = cv_.wait_until(lock, deadline, [&] {
      auto it = outcomes_.find(index);
      return it != outcomes_.end() &&
             (it->second.acked || (it->second.session_ended && !it->second.last_error.empty()));
    });
    if (!done) {
      auto it = outcomes_.find(index);
      if (it != outcomes_.end()) return it->second;
      return std::nullopt;
    }
    return outcomes_[index];
  }

  static constexpr uint32_t kFrameBytes = 65536;

 private:
  std::vector<FakeTransfer> transfers_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t next_ = 0;
  size_t allowed_ = std::numeric_limits<size_t>::max();
  int awaiting_error_ = -1;
  std::map<size_t, FakeOutcome> outcomes_;
  std::string sub_control_;
  std::atomic<uint64_t> sessions_{0};
  std::atomic<uint32_t> digest_format_{1};
};

// Cuts each object (tensor index = position) into frames of `version`, then the VersionEnd with
// the digests and their version digest: the part every fake transfer shares.
void AppendFramesAndEnd(std::vector<v1::PublisherMessage>& out,
                        const std::vector<std::span<const uint8_t>>& objects, uint64_t version,
                        const std::vector<v1::TensorSpec>& specs,
                        const std::vector<uint64_t>& digests) {
  uint64_t frames = 0, wire = 0;
  for (size_t i = 0; i < objects.size(); ++i) {
    sync::SplitOptions so;
    so.frame_bytes = FakePublisher::kFrameBytes;
    absl::StatusOr<std::vector<v1::DataFrame>> fs = sync::SplitObject(
        objects[i], sync::FrameTarget{version, static_cast<uint32_t>(i), 0}, so);
    if (!fs.ok()) {
      out.clear();
      return;
    }
    for (v1::DataFrame& f : *fs) {
      ++frames;
      wire += f.payload().size();
      v1::PublisherMessage fm;
      *fm.mutable_frame() = std::move(f);
      out.push_back(std::move(fm));
    }
  }
  v1::PublisherMessage em;
  v1::VersionEnd* e = em.mutable_end();
  e->set_version(version);
  for (uint64_t d : digests) e->add_digests(d);
  absl::StatusOr<uint64_t> vd = sync::VersionDigest(specs, digests);
  e->set_version_digest(vd.ok() ? *vd : 0);
  e->set_frames(frames);
  e->set_wire_bytes(wire);
  out.push_back(em);
}

// A keyframe transfer of `model` as version `version` on top of `applied`, built exactly as a
// publisher would (frames, checksums, digests, version digest).
std::vector<v1::PublisherMessage> KeyframeTransfer(const Model& model, uint64_t version,
                                                   uint64_t applied, bool digest_v2 = false) {
  Model sorted = model;
  sorted.SortByName();
  std::vector<v1::PublisherMessage> out;
  v1::PublisherMessage hm;
  v1::VersionHeader* h = hm.mutable_header();
  h->set_version(version);
  h->set_base_version(applied);
  h->set_reason(applied == 0 ? v1::TRANSFER_REASON_BOOTSTRAP : v1::TRANSFER_REASON_REQUESTED);
  std::vector<v1::TensorSpec> specs;
  std::vector<uint64_t> digests;
  uint64_t elements = 0;
  for (const ModelTensor& t : sorted.tensors) {
    v1::TensorPlan* p = h->add_tensors();
    p->mutable_spec()->set_name(t.name);
    p->mutable_spec()->set_dtype(sync::ToProtoDType(t.dtype));
    for (int64_t d : t.shape) p->mutable_spec()->add_shape(static_cast<uint64_t>(d));
    p->set_delivery(v1::DELIVERY_KEYFRAME);
    specs.push_back(p->spec());
    digests.push_back(digest_v2 ? TensorDigestV2(t.data) : TensorDigest(t.data));
    elements += t.data.size() / 2;
  }
  out.push_back(hm);
  std::vector<std::span<const uint8_t>> objects;
  for (const ModelTensor& t : sorted.tensors) objects.emplace_back(t.data);
  AppendFramesAndEnd(out, objects, version, specs, digests);
  if (out.empty()) return out;
  v1::VersionEnd* e = out.back().mutable_end();
  e->set_dense_bytes(sorted.bytes());
  e->set_changed_elements(elements);
  e->set_total_elements(elements);
  return out;
}

// A delta transfer from `base` (the subscriber's applied version `applied`) to `model` as
// `version`, in digest v2, one patch step per tensor (EncodePatch), as a publisher builds it;
// `mutate` may change a tensor's patch before it is cut into frames (the frames' checksums are
// then those of the changed bytes: only the patch's own checks can catch it).
std::vector<v1::PublisherMessage> PatchTransfer(
    const Model& base, const Model& model, uint64_t version, uint64_t applied,
    const std::function<void(const std::string&, std::vector<uint8_t>&)>& mutate = nullptr) {
  Model sorted = model;
  sorted.SortByName();
  std::vector<v1::PublisherMessage> out;
  v1::PublisherMessage hm;
  v1::VersionHeader* h = hm.mutable_header();
  h->set_version(version);
  h->set_base_version(applied);
  h->set_reason(v1::TRANSFER_REASON_NEXT_VERSION);
  std::vector<v1::TensorSpec> specs;
  std::vector<uint64_t> digests;
  std::vector<std::vector<uint8_t>> patches;
  for (const ModelTensor& t : sorted.tensors) {
    v1::TensorPlan* p = h->add_tensors();
    p->mutable_spec()->set_name(t.name);
    p->mutable_spec()->set_dtype(sync::ToProtoDType(t.dtype));
    for (int64_t d : t.shape) p->mutable_spec()->add_shape(static_cast<uint64_t>(d));
    p->set_delivery(v1::DELIVERY_PATCH);
    v1::PatchStep* step = p->add_steps();
    step->set_base_version(applied);
    step->set_target_version(version);
    specs.push_back(p->spec());
    digests.push_back(TensorDigestV2(t.data));
    absl::StatusOr<std::vector<uint8_t>> patch =
        EncodePatch(t.dtype, base.Find(t.name)->data, t.data);
    if (!patch.ok()) return {};
    if (mutate) mutate(t.name, *patch);
    patches.push_back(std::move(*patch));
  }
  out.push_back(hm);
  std::vector<std::span<const uint8_t>> objects(patches.begin(), patches.end());
  AppendFramesAndEnd(out, objects, version, specs, digests);
  return out;
}

// Index of the first DataFrame message.
size_t FirstFrame(const std::vector<v1::PublisherMessage>& msgs) {
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (msgs[i].has_frame()) return i;
  }
  return 0;
}

TEST_F(E2EBadInput, SubscriberRejectsBrokenTransfersFromAFakePublisherAndKeepsItsVersion) {
  const Model m1 = RandomModel(21, {{"t.alpha", 40000}, {"t.beta", 3000}});
  Model m2 = m1;
  PerturbModel(m2, 0.05, 22);
  std::vector<FakeTransfer> transfers;
  transfers.push_back({"good v1", [&](uint64_t a) { return KeyframeTransfer(m1, 1, a); }, true, {}});
  transfers.push_back({"bad frame checksum", [&](uint64_t a) {
                         auto msgs = KeyframeTransfer(m2, 2, a);
                         msgs[FirstFrame(msgs)].mutable_frame()->set_checksum(
                             msgs[FirstFrame(msgs)].frame().checksum() ^ 1);
                         return msgs;
                       }, false, {"checksum"}});
  transfers.push_back({"frame of an older version", [&](uint64_t a) {
                         auto msgs = KeyframeTransfer(m2, 2, a);
                         msgs[FirstFrame(msgs)].mutable_frame()->set_version(1);
                         return msgs;
                       }, false, {"version"}});
  transfers.push_back({"wrong digest in VersionEnd", [&](uint64_t a) {
                         auto msgs = KeyframeTransfer(m2, 2, a);
                         v1::VersionEnd* e = msgs.back().mutable_end();
                         e->set_digests(1, e->digests(1) ^ 0x5555);
                         return msgs;
                       }, false, {"digest", "t.beta"}});
  transfers.push_back({"unknown tensor index", [&](uint64_t a) {
                         auto msgs = KeyframeTransfer(m2, 2, a);
                         msgs[FirstFrame(msgs)].mutable_frame()->set_tensor_index(7);
                         return msgs;
                       }, false, {"tensor", "index"}});
  transfers.push_back({"wrong-size tensor", [&](uint64_t a) {
                         // t.beta's keyframe claims (and carries) 2 bytes fewer than its spec.
                         auto msgs = KeyframeTransfer(m2, 2, a);
                         for (v1::PublisherMessage& m : msgs) {
                           if (!m.has_frame() || m.frame().tensor_index() != 1) continue;
                           v1::DataFrame* f = m.mutable_frame();
                           std::string p = f->payload();
                           p.resize(p.size() - 2);
                           f->set_payload(p);
                           f->set_raw_bytes(p.size());
                           f->set_object_bytes(f->object_bytes() - 2);
                           f->set_checksum(sync::FrameChecksum(p));
                         }
                         return msgs;
                       }, false, {"bytes", "size", "t.beta"}});
  transfers.push_back({"VersionHeader not above the applied version", [&](uint64_t a) {
                         auto msgs = KeyframeTransfer(m2, a, a);  // version == applied
                         return msgs;
                       }, false, {"version"}});
  transfers.push_back({"good v2", [&](uint64_t a) { return KeyframeTransfer(m2, 2, a); }, true, {}});
  Model m3 = m2;
  PerturbModel(m3, 0.05, 23);
  transfers.push_back({"frame of a later version", [&](uint64_t a) {
                         auto msgs = KeyframeTransfer(m3, 3, a);
                         msgs[FirstFrame(msgs)].mutable_frame()->set_version(4);
                         return msgs;
                       }, false, {"version"}});

  FakePublisher fake(transfers);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterService(&fake);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  // Ends the fake's calls (a handler may be blocked reading a silent subscriber) on every exit.
  absl::Cleanup stop_server = [&server] {
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  };

  // Meanwhile a real publisher keeps serving a real subscriber.
  PublisherSpec rps;
  rps.name = "real-pub";
  absl::StatusOr<PubSub> real = StartPubSub("bystander", rps);
  E2E_ASSERT_OK(real);
  DaemonProcess& real_pub = *real->pub;
  DaemonProcess& bystander = *real->sub;
  E2E_ASSERT_OK(Publish(real_pub, m1, 1));

  SubscriberSpec ss;
  ss.name = "victim";
  ss.upstream = {absl::StrCat("127.0.0.1:", port)};
  ss.connections = 1;
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  fake.set_subscriber_control(sub.control_target());

  uint64_t held = 0;
  for (size_t i = 0; i < transfers.size(); ++i) {
    const FakeTransfer& t = transfers[i];
    std::optional<FakeOutcome> o = fake.WaitOutcome(i, absl::Seconds(15));
    if (!o.has_value()) {
      ADD_FAILURE() << t.what << ": the subscriber neither acked nor ended the session within "
                    << "15 s (hung on it?)\n" << sub.LogTail();
      break;
    }
    if (t.must_apply) {
      ASSERT_TRUE(o->acked) << t.what << ": session ended: " << o->last_error;
      EXPECT_EQ(o->ack.result(), v1::ACK_RESULT_APPLIED) << t.what << ": " << o->ack.ShortDebugString();
      held = o->ack.applied_version();
      continue;
    }
    const std::string reason = o->acked ? o->ack.error() : o->last_error;
    std::printf("[e2e] fake publisher, %s -> %s: %s\n", t.what.c_str(),
                o->acked ? (o->ack.result() == v1::ACK_RESULT_REJECTED ? "Ack REJECTED" : "Ack ?")
                         : "session ended",
                reason.c_str());
    if (o->acked) {
      EXPECT_EQ(o->ack.result(), v1::ACK_RESULT_REJECTED) << t.what << " was applied";
      EXPECT_EQ(o->ack.applied_version(), held) << t.what << ": the subscriber kept version " << held;
      if (t.what == "wrong digest in VersionEnd") {
        ASSERT_EQ(o->ack.mismatched_tensors_size(), 1) << o->ack.ShortDebugString();
        EXPECT_EQ(o->ack.mismatched_tensors(0), "t.beta");
      }
    } else {
      EXPECT_TRUE(o->session_ended);
      EXPECT_FALSE(o->last_error.empty()) << t.what << ": subscriber's upstream.last_error is empty";
      EXPECT_EQ(o->version_at_reconnect, held)
          << t.what << ": the subscriber's Hello after the session held another version";
    }
    EXPECT_TRUE(ContainsAny(reason, t.words))
        << t.what << ": the rejection '" << reason << "' names none of " << Join(t.words);
  }
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m2));
  E2E_ASSERT_OK(ExpectVerified(sub));
  ASSERT_TRUE(sub.running()) << sub.LogTail();
  E2E_ASSERT_OK(WaitVersion(bystander, 1));
  E2E_ASSERT_OK(Publish(real_pub, m2, 2));
  E2E_ASSERT_OK(WaitVersion(bystander, 2));
  E2E_ASSERT_OK(ExpectExportEquals(bystander, m2));
  E2E_EXPECT_OK(sub.Terminate().status());
}

// A single-copy subscriber (store.slots 1) verifies a delta as change sets before it writes a
// byte: a patch whose payload is damaged (frames intact) and a well-formed patch of other values
// (re-signed) are both rejected, the held version is exported unchanged after each, and a good
// patch then applies in place.
TEST_F(E2EBadInput, ASingleCopySubscriberRejectsBadPatchesBeforeWritingAnything) {
  const Model m1 = RandomModel(31, {{"t.alpha", 40000}, {"t.beta", 3000}});
  Model m2 = m1;
  PerturbModel(m2, 0.0165, 32);
  std::vector<FakeTransfer> transfers;
  transfers.push_back({"good v1", [&](uint64_t a) { return KeyframeTransfer(m1, 1, a, true); },
                       true, {}});
  transfers.push_back({"damaged patch payload", [&](uint64_t a) {
                         return PatchTransfer(m1, m2, 2, a, [](const std::string& t, auto& p) {
                           if (t == "t.alpha") p[p.size() - 2] ^= 0x10;
                         });
                       }, false, {"checksum", "t.alpha"}});
  transfers.push_back({"well-formed patch of other values", [&](uint64_t a) {
                         return PatchTransfer(m1, m2, 2, a, [](const std::string& t, auto& p) {
                           if (t != "t.beta") return;
                           p[p.size() - 1] ^= 0x01;
                           (void)refit::testing::ResignPatch(p);
                         });
                       }, false, {"digest", "t.beta"}});
  transfers.push_back({"good v2", [&](uint64_t a) { return PatchTransfer(m1, m2, 2, a); }, true, {}});

  FakePublisher fake(transfers);
  fake.set_digest_format(2);
  fake.Allow(1);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterService(&fake);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  absl::Cleanup stop_server = [&server] {
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  };
  SubscriberSpec ss;
  ss.name = "single";
  ss.upstream = {absl::StrCat("127.0.0.1:", port)};
  ss.connections = 1;
  ss.slots = 1;
  ss.digest_v2 = true;
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  fake.set_subscriber_control(sub.control_target());
  for (size_t i = 0; i < transfers.size(); ++i) {
    const FakeTransfer& t = transfers[i];
    std::optional<FakeOutcome> o = fake.WaitOutcome(i, absl::Seconds(15));
    ASSERT_TRUE(o.has_value() && o->acked) << t.what << ": no Ack\n" << sub.LogTail();
    if (t.must_apply) {
      EXPECT_EQ(o->ack.result(), v1::ACK_RESULT_APPLIED) << t.what << ": " << o->ack.error();
      fake.Allow(i + 2);
      continue;
    }
    std::printf("[e2e] single copy, %s -> %s\n", t.what.c_str(), o->ack.error().c_str());
    EXPECT_EQ(o->ack.result(), v1::ACK_RESULT_REJECTED) << t.what << " was applied";
    EXPECT_EQ(o->ack.applied_version(), 1u) << t.what;
    EXPECT_TRUE(ContainsAny(o->ack.error(), t.words))
        << t.what << ": '" << o->ack.error() << "' names none of " << Join(t.words);
    E2E_EXPECT_OK(ExpectExportEquals(sub, m1));  // nothing of the bad version was written
    fake.Allow(i + 2);
  }
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  E2E_ASSERT_OK(ExpectExportEquals(sub, m2));
  E2E_ASSERT_OK(ExpectVerified(sub));
  E2E_EXPECT_OK(sub.Terminate().status());
}

// ---- bad configs and command lines ----------------------------------------------------------------

struct CliCase {
  std::string what;
  std::vector<std::string> args;
  std::vector<std::string> words;
};

void ExpectUsageError(const CliCase& c, const CommandResult& r) {
  std::printf("[e2e] %s -> exit %d: %s", c.what.c_str(), r.exit_code, r.err.c_str());
  EXPECT_EQ(r.exit_code, 2) << c.what << ": " << r.Describe();
  const std::string err(absl::StripAsciiWhitespace(r.err));
  EXPECT_FALSE(err.empty()) << c.what << ": nothing on stderr";
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 0) << c.what << ": not one line: " << err;
  EXPECT_TRUE(ContainsAny(err, c.words)) << c.what << ": '" << err << "' names none of "
                                         << Join(c.words);
}

TEST_F(E2EBadInput, BadConfigsAndCommandLinesExitTwoWithOneLineNamingTheProblem) {
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(Path(name)) << text;
    return Path(name);
  };
  const std::string good = write("good.yaml", PublisherYaml(PublisherSpec{}, dir(), Path("x.ready")));
  const std::string unknown_key =
      write("unknown.yaml", "publisher:\n  listen: \"127.0.0.1:0\"\n  bogus_key: 1\n");
  const std::string public_plain = write("public.yaml", "publisher:\n  listen: \"0.0.0.0:0\"\n");
  const std::string bad_range =
      write("range.yaml", "publisher:\n  listen: \"127.0.0.1:0\"\n  transport:\n    frame_bytes: 12\n");
  const std::string bad_address = write("address.yaml", "publisher:\n  listen: \"127.0.0.1:99999\"\n");
  const std::string no_upstream = write("noup.yaml", "subscriber:\n  listen: \"127.0.0.1:0\"\n");
  const std::string missing_cert = write(
      "cert.yaml", absl::StrCat("publisher:\n  listen: \"127.0.0.1:0\"\n  tls:\n    cert: \"",
                                Path("nope.crt"), "\"\n    key: \"", Path("nope.key"), "\"\n    ca: \"",
                                Path("nope-ca.crt"), "\"\n"));
  const std::string not_yaml = write("broken.yaml", "publisher: [unclosed\n");
  const std::vector<CliCase> refitd = {
      {"refitd without arguments", {}, {"usage", "role", "publisher"}},
      {"refitd with an unknown role", {"relay", "--config", good}, {"relay"}},
      {"refitd publisher without --config", {"publisher"}, {"--config"}},
      {"refitd with an unknown flag", {"publisher", "--config", good, "--frobnicate"}, {"--frobnicate"}},
      {"refitd with a missing config file", {"publisher", "--config", Path("missing.yaml")}, {"missing.yaml"}},
      {"config with an unknown key", {"publisher", "--config", unknown_key}, {"bogus_key"}},
      {"plaintext on a non-loopback address", {"publisher", "--config", public_plain},
       {"tls", "insecure"}},
      {"frame_bytes out of range", {"publisher", "--config", bad_range}, {"frame_bytes"}},
      {"port out of range", {"publisher", "--config", bad_address}, {"99999", "port"}},
      {"subscriber without upstream", {"subscriber", "--config", no_upstream}, {"upstream"}},
      {"missing TLS files", {"publisher", "--config", missing_cert}, {"nope"}},
      {"not YAML", {"publisher", "--config", not_yaml}, {"broken.yaml"}},
      {"wrong role section", {"subscriber", "--config", good}, {"subscriber"}},
  };
  for (const CliCase& c : refitd) ExpectUsageError(c, RunRefitd(c.args));

  const std::vector<CliCase> refitctl = {
      {"refitctl without arguments", {}, {"--target", "usage", "verb", "command"}},
      {"refitctl without --target", {"status"}, {"--target"}},
      {"refitctl without a verb", {"--target", "127.0.0.1:9"}, {"verb", "usage", "command"}},
      {"refitctl with an unknown verb", {"--target", "127.0.0.1:9", "frobnicate"}, {"frobnicate"}},
      {"publish without --safetensors", {"--target", "127.0.0.1:9", "publish"}, {"--safetensors"}},
      {"wait without --version", {"--target", "127.0.0.1:9", "wait"}, {"--version"}},
      {"wait with a non-numeric version", {"--target", "127.0.0.1:9", "wait", "--version", "abc"},
       {"abc", "--version"}},
      {"export without --safetensors", {"--target", "127.0.0.1:9", "export"}, {"--safetensors"}},
      {"a malformed target", {"--target", "127.0.0.1:notaport", "status"}, {"notaport", "port", "--target"}},
      {"plaintext to a non-loopback target", {"--target", "192.0.2.10:7400", "status"},
       {"--insecure", "tls"}},
      {"TLS flags without a CA", {"--target", "127.0.0.1:9", "--tls-cert", Path("c.crt"), "status"},
       {"--tls"}},
  };
  for (const CliCase& c : refitctl) ExpectUsageError(c, RunRefitctl(c.args));
}

}  // namespace
}  // namespace refit::e2e

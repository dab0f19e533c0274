// Security of version numbering, the publish path and the persisted baseline, against real
// daemon processes (data.proto "Versions and lineage"; docs/ARCHITECTURE.md):
//   - a version above kMaxVersion is refused and does not kill the numbering;
//   - a raw DataPlane client's Hello (version 2^64-1, a foreign lineage, a wrong digest) never
//     moves the numbering, gets keyframes, and keeps `wait --all-subscribers` from succeeding;
//   - publishes are idempotent by request id, a publish whose deadline passed is not run, a full
//     queue is RESOURCE_EXHAUSTED;
//   - SIGTERM ends the daemon within the documented bound while a publish is stuck and while the
//     config is being read;
//   - a corrupt baseline is moved aside (Status says so), stale temporary files are removed, a
//     second publisher on the same persist_dir is refused, a failed persist shows in Status.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/status_matchers.h"
#include "daemon/common/test_hooks.h"
#include "daemon/sync/versions.h"
#include "gtest/gtest.h"
#include "refit/v1/data.grpc.pb.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

namespace fs = std::filesystem;

// refitd's documented shutdown bound (daemon/cli/shutdown_watcher.h kShutdownWatchdog) and the
// exit status of a shutdown it had to cut short; plus slack for a loaded CI machine.
constexpr absl::Duration kShutdownBound = absl::Seconds(10);
constexpr int kExitShutdownTimedOut = 3;
constexpr absl::Duration kSlack = absl::Seconds(15);

Model SmallModel(uint64_t seed) { return RandomModel(seed, {{"w.a", 20000}, {"w.b", 3000}}); }

bool LogContains(const DaemonProcess& d, const std::string& needle) {
  std::ifstream in(d.log_path());
  std::stringstream ss;
  ss << in.rdbuf();
  return absl::StrContains(ss.str(), needle);
}

// A raw DataPlane session: Hello, Welcome, then whatever the publisher sends.
class RawSubscriber {
 public:
  explicit RawSubscriber(const std::string& target)
      : stub_(v1::DataPlane::NewStub(PlainChannel(target))) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stream_ = stub_->Sync(&ctx_);
  }
  ~RawSubscriber() {
    ctx_.TryCancel();
    (void)stream_->Finish();
  }

  absl::StatusOr<v1::Welcome> Hello(uint64_t version, uint64_t digest, uint64_t lineage) {
    v1::SubscriberMessage m;
    v1::Hello* h = m.mutable_hello();
    h->set_protocol(v1::PROTOCOL_VERSION_1);
    h->set_name("raw");
    h->set_version(version);
    h->set_version_digest(digest);
    h->set_lineage(lineage);
    h->set_max_frame_bytes(4u << 20);
    h->add_patch_formats(1);
    if (!stream_->Write(m)) return absl::UnavailableError("writing Hello failed");
    v1::PublisherMessage w;
    if (!stream_->Read(&w) || !w.has_welcome()) return absl::UnavailableError("no Welcome");
    return w.welcome();
  }

  absl::StatusOr<v1::VersionHeader> NextHeader() {
    v1::PublisherMessage m;
    while (stream_->Read(&m)) {
      if (m.has_header()) return m.header();
    }
    return absl::UnavailableError("stream ended before a VersionHeader");
  }

 private:
  std::unique_ptr<v1::DataPlane::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SubscriberMessage, v1::PublisherMessage>> stream_;
};

// Control Publish over gRPC with its own deadline.
absl::Status RpcPublish(const std::string& target, const std::string& file,
                        const std::string& request_id, absl::Duration timeout,
                        v1::PublishResponse* resp = nullptr) {
  auto stub = v1::Control::NewStub(PlainChannel(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::PublishRequest req;
  req.add_safetensors(file);
  req.set_request_id(request_id);
  v1::PublishResponse local;
  grpc::Status st = stub->Publish(&ctx, req, resp != nullptr ? resp : &local);
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
}

class E2ESecurityVersionsTest : public E2ETest {
 protected:
  void TearDown() override {
    unsetenv(TestHooks::kEnv);
    E2ETest::TearDown();
  }

  // Arms the test hooks (test_hooks.h) of the daemons started from now on: their directory.
  TestHooks ArmHooks() {
    const std::string dir = Path("hooks");
    fs::create_directories(dir);
    setenv(TestHooks::kEnv, dir.c_str(), 1);
    return TestHooks(dir);
  }

  CommandResult Refitctl(const DaemonProcess& d, std::vector<std::string> args) {
    args.insert(args.begin(), {"--target", d.control_target()});
    return RunRefitctl(args);
  }

  uint64_t StatusVersion(const DaemonProcess& d) {
    absl::StatusOr<v1::StatusResponse> st = RpcStatus(d.control_target());
    return st.ok() ? st->version() : 0;
  }
};

TEST_F(E2ESecurityVersionsTest, VersionAboveTheBoundIsRefusedAndNumberingSurvives) {
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  E2E_ASSERT_OK(pub.Start());
  REFIT_ASSERT_OK_AND_ASSIGN(std::string file, WriteModelFile(SmallModel(1), "m1"));

  CommandResult huge =
      Refitctl(pub, {"publish", "--safetensors", file, "--version", "18446744073709551615"});
  EXPECT_NE(huge.exit_code, 0) << huge.Describe();
  EXPECT_TRUE(absl::StrContains(huge.err, "INVALID_ARGUMENT")) << huge.Describe();
  EXPECT_TRUE(absl::StrContains(huge.err, absl::StrCat(sync::kMaxVersion))) << huge.Describe();
  CommandResult above = Refitctl(
      pub, {"publish", "--safetensors", file, "--version", absl::StrCat(sync::kMaxVersion + 1)});
  EXPECT_NE(above.exit_code, 0) << above.Describe();

  CommandResult next = Refitctl(pub, {"publish", "--safetensors", file});
  ASSERT_EQ(next.exit_code, 0) << next.Describe();
  EXPECT_TRUE(absl::StrContains(next.out, "published version 1 ")) << next.Describe();
  CommandResult again = Refitctl(pub, {"publish", "--safetensors", file});
  ASSERT_EQ(again.exit_code, 0) << again.Describe();
  EXPECT_TRUE(absl::StrContains(again.out, "published version 2 ")) << again.Describe();
}

TEST_F(E2ESecurityVersionsTest, HelloAtMaxVersionOrForeignLineageGetsKeyframesNotTheNumbering) {
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  E2E_ASSERT_OK(pub.Start());
  E2E_ASSERT_OK(Publish(pub, SmallModel(1), 1));

  for (const auto& [version, foreign] :
       std::vector<std::pair<uint64_t, bool>>{{UINT64_MAX, false}, {5, true}}) {
    SCOPED_TRACE(absl::StrCat("Hello version ", version, foreign ? " of a foreign lineage" : ""));
    RawSubscriber raw(pub.listen_target());
    REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, RpcStatus(pub.control_target()));
    ASSERT_NE(st.lineage(), 0u);
    const uint64_t lineage = foreign ? st.lineage() ^ 0x5a5a5a5a5a5a5a5aull : st.lineage();
    REFIT_ASSERT_OK_AND_ASSIGN(v1::Welcome welcome, raw.Hello(version, 0x1234, lineage));
    EXPECT_EQ(welcome.lineage(), st.lineage());
    // It holds nothing of this publisher's: a full keyframe of the newest version.
    REFIT_ASSERT_OK_AND_ASSIGN(v1::VersionHeader header, raw.NextHeader());
    EXPECT_EQ(header.base_version(), 0u);
    EXPECT_EQ(header.version(), st.version());
    EXPECT_EQ(header.lineage(), st.lineage());
    for (const v1::TensorPlan& t : header.tensors()) {
      EXPECT_EQ(t.delivery(), v1::DELIVERY_KEYFRAME) << t.spec().name();
    }
    // The numbering did not move: the next automatic version is newest + 1.
    absl::StatusOr<std::string> file =
        WriteModelFile(SmallModel(10 + st.version()), absl::StrCat("next-", st.version()));
    ASSERT_THAT(file, IsOk());
    CommandResult next = Refitctl(pub, {"publish", "--safetensors", *file});
    ASSERT_EQ(next.exit_code, 0) << next.Describe();
    EXPECT_TRUE(
        absl::StrContains(next.out, absl::StrCat("published version ", st.version() + 1, " ")))
        << next.Describe();
  }
}

TEST_F(E2ESecurityVersionsTest, WaitAllSubscribersFailsWhileOneHoldsTheNumberWithAnotherDigest) {
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  E2E_ASSERT_OK(pub.Start());
  E2E_ASSERT_OK(Publish(pub, SmallModel(1), 1));
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, RpcStatus(pub.control_target()));

  // Same lineage, same number, another digest (a subscriber that failed over from a publisher
  // that reused the number): it is not caught up.
  RawSubscriber raw(pub.listen_target());
  ASSERT_THAT(raw.Hello(1, st.version_digest() ^ 1, st.lineage()), IsOk());
  absl::StatusOr<v1::StatusResponse> with = PollStatus(
      pub.control_target(), [](const v1::StatusResponse& s) { return s.sessions_size() == 1; },
      absl::Seconds(20), "the raw session is listed");
  ASSERT_THAT(with, IsOk());
  EXPECT_EQ(with->sessions(0).lag_versions(), 1u) << "lag of a subscriber with another digest";

  CommandResult wait = Refitctl(pub, {"wait", "--version", "1", "--all-subscribers", "--timeout",
                                      "1"});
  EXPECT_NE(wait.exit_code, 0) << wait.Describe();
  EXPECT_TRUE(absl::StrContains(wait.err, "another digest")) << wait.Describe();
}

TEST_F(E2ESecurityVersionsTest, FailoverToAPublisherOfAnotherLineageReplacesTheVersion) {
  DaemonProcess& a = NewPublisher(PublisherSpec());
  E2E_ASSERT_OK(a.Start());
  PublisherSpec b_spec;
  b_spec.name = "pub-b";
  DaemonProcess& b = NewPublisher(b_spec);
  E2E_ASSERT_OK(b.Start());
  SubscriberSpec ss;
  ss.name = "sub";
  ss.upstream = {a.listen_target(), b.listen_target()};
  DaemonProcess& sub = NewSubscriber(ss);
  E2E_ASSERT_OK(sub.Start());
  E2E_ASSERT_OK(Publish(a, SmallModel(1), 1));
  E2E_ASSERT_OK(Publish(a, SmallModel(2), 2));
  E2E_ASSERT_OK(WaitVersion(sub, 2));
  // B numbers independently: its version 1 is another model, below the subscriber's 2.
  const Model other = SmallModel(3);
  E2E_ASSERT_OK(Publish(b, other, 1));
  E2E_ASSERT_OK(a.Kill());
  // The subscriber fails over to B, is diverged (another lineage), and takes B's version 1.
  E2E_ASSERT_OK(WaitVersion(b, 1, absl::Seconds(60), /*all_subscribers=*/true));
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      sub.control_target(), [](const v1::StatusResponse& s) { return s.version() == 1; },
      absl::Seconds(30), "the subscriber holds B's version 1");
  ASSERT_THAT(st, IsOk()) << st.status() << "\n" << sub.LogTail();
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse bst, RpcStatus(b.control_target()));
  EXPECT_EQ(st->version_digest(), bst.version_digest());
  EXPECT_EQ(st->lineage(), bst.lineage());
  E2E_EXPECT_OK(ExpectExportEquals(sub, other));
  EXPECT_TRUE(LogContains(sub, "the upstream changed lineage")) << sub.LogTail();
}

TEST_F(E2ESecurityVersionsTest, RetryWithTheSameRequestIdPublishesOnce) {
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  E2E_ASSERT_OK(pub.Start());
  REFIT_ASSERT_OK_AND_ASSIGN(std::string file, WriteModelFile(SmallModel(1), "m1"));
  for (int i = 0; i < 2; ++i) {
    CommandResult r = Refitctl(pub, {"publish", "--safetensors", file, "--request-id", "job-42"});
    ASSERT_EQ(r.exit_code, 0) << r.Describe();
    EXPECT_TRUE(absl::StrContains(r.out, "published version 1 ")) << "attempt " << i << ": "
                                                                   << r.Describe();
  }
  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, RpcStatus(pub.control_target()));
  EXPECT_EQ(st.version(), 1u);
  EXPECT_EQ(st.history().versions(), 1u) << "published once";
  REFIT_ASSERT_OK_AND_ASSIGN(std::string other, WriteModelFile(SmallModel(2), "m2"));
  CommandResult misuse =
      Refitctl(pub, {"publish", "--safetensors", other, "--request-id", "job-42"});
  EXPECT_NE(misuse.exit_code, 0) << misuse.Describe();
  EXPECT_TRUE(absl::StrContains(misuse.err, "INVALID_ARGUMENT")) << misuse.Describe();
}

TEST_F(E2ESecurityVersionsTest, ExpiredPublishIsNotRunAndAFullQueueIsResourceExhausted) {
  const std::string stall = ArmHooks().File(TestHook::kStallPublish);
  PublisherSpec spec;
  spec.extra = "  publish_queue:\n    max_pending: 2\n";
  DaemonProcess& pub = NewPublisher(spec);
  E2E_ASSERT_OK(pub.Start());
  absl::StatusOr<std::string> a = WriteModelFile(SmallModel(1), "a");
  absl::StatusOr<std::string> b = WriteModelFile(SmallModel(2), "b");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  { std::ofstream(stall) << "stall\n"; }

  // A starts and sticks; its caller gives up (the job keeps running: it completes later).
  EXPECT_EQ(RpcPublish(pub.control_target(), *a, "a", absl::Seconds(1)).code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::StatusOr<v1::StatusResponse> running = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& s) { return s.publish_queue().pending() == 1; },
      absl::Seconds(20), "A running");
  ASSERT_THAT(running, IsOk());
  // B queues behind it; its deadline passes before it starts.
  EXPECT_EQ(RpcPublish(pub.control_target(), *b, "b", absl::Seconds(1)).code(),
            absl::StatusCode::kDeadlineExceeded);
  // The publisher notices B's deadline on its own (within its 200 ms poll) and drops it.
  absl::StatusOr<v1::StatusResponse> dropped = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& s) {
        return s.publish_queue().dropped_expired() == 1 && s.publish_queue().pending() == 1;
      },
      absl::Seconds(20), "B dropped");
  ASSERT_THAT(dropped, IsOk());
  // C waits long, D finds the queue full (A running + C queued = max_pending 2).
  absl::Status c_status;
  std::thread c([&] { c_status = RpcPublish(pub.control_target(), *b, "c", absl::Seconds(60)); });
  absl::StatusOr<v1::StatusResponse> full = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& s) { return s.publish_queue().pending() == 2; },
      absl::Seconds(20), "C queued");
  absl::Status d = RpcPublish(pub.control_target(), *b, "d", absl::Seconds(10));
  EXPECT_EQ(d.code(), absl::StatusCode::kResourceExhausted) << d;
  EXPECT_TRUE(absl::StrContains(d.message(), "max_pending")) << d;
  std::filesystem::remove(stall);
  c.join();
  ASSERT_THAT(full, IsOk());
  EXPECT_THAT(c_status, IsOk());

  REFIT_ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, RpcStatus(pub.control_target()));
  EXPECT_EQ(st.publish_queue().dropped_expired(), 1u) << "B was dropped";
  EXPECT_EQ(st.publish_queue().refused_full(), 1u) << "D was refused";
  EXPECT_EQ(st.history().versions(), 2u) << "A and C ran, B did not";
  // (gRPC may cancel the call at its deadline before the publisher's own deadline check: the
  // log then says "call was cancelled"; either way B never ran.)
  EXPECT_TRUE(LogContains(pub, "from control (" + *b + ") request b not published: its caller's"))
      << pub.LogTail();
}

TEST_F(E2ESecurityVersionsTest, SigtermDuringAStuckPublishExitsWithinTheBound) {
  const std::string stall = ArmHooks().File(TestHook::kStallPublish);
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  E2E_ASSERT_OK(pub.Start());
  REFIT_ASSERT_OK_AND_ASSIGN(std::string a, WriteModelFile(SmallModel(1), "a"));
  { std::ofstream(stall) << "stall\n"; }
  EXPECT_EQ(RpcPublish(pub.control_target(), a, "a", absl::Seconds(1)).code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_THAT(PollStatus(
                  pub.control_target(),
                  [](const v1::StatusResponse& s) { return s.publish_queue().pending() == 1; },
                  absl::Seconds(20), "the publish is stuck"),
              IsOk());
  absl::StatusOr<int> code = pub.Terminate(kShutdownBound + kSlack);
  ASSERT_THAT(code, IsOk()) << code.status() << "\n" << pub.LogTail();
  EXPECT_EQ(*code, kExitShutdownTimedOut) << pub.LogTail();
  EXPECT_TRUE(LogContains(pub, "shutdown did not finish")) << pub.LogTail();
}

TEST_F(E2ESecurityVersionsTest, SigtermWhileStartingExitsAtOnce) {
  // Nothing in start-up blocks by itself any more (a FIFO as --config is refused at once:
  // e2e_security_files_test), so the start-up hook holds refitd before it reads its config while
  // the file exists; SIGTERM must end it then (it used to be blocked until serving).
  const std::string stall = ArmHooks().File(TestHook::kStallStart);
  { std::ofstream(stall) << "stall\n"; }
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  (void)pub.Start(absl::Milliseconds(1));  // spawns; no ready file will come
  unsetenv(TestHooks::kEnv);
  // The hook logs when it holds start-up: poll the log (no event announces it).
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       absl::Now() < until && pub.running() && !LogContains(pub, "start-up waits");) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(LogContains(pub, "start-up waits")) << pub.LogTail();
  absl::StatusOr<int> code = pub.Terminate(kShutdownBound + kSlack);
  ASSERT_THAT(code, IsOk()) << code.status() << "\n" << pub.LogTail();
  EXPECT_EQ(*code, 128 + SIGTERM) << pub.LogTail();
  EXPECT_TRUE(LogContains(pub, "shutdown signal while starting")) << pub.LogTail();
}

TEST_F(E2ESecurityVersionsTest, CorruptBaselineIsMovedAsideAndStaleTempFilesRemoved) {
  PublisherSpec spec;
  spec.persist_dir = Path("persist");
  DaemonProcess& pub = NewPublisher(spec);
  E2E_ASSERT_OK(pub.Start());
  E2E_ASSERT_OK(Publish(pub, SmallModel(1), 1));
  absl::StatusOr<int> stopped = pub.Terminate();
  ASSERT_THAT(stopped, IsOk()) << pub.LogTail();
  ASSERT_EQ(*stopped, 0) << pub.LogTail();

  const std::string baseline = spec.persist_dir + "/baseline.safetensors";
  {  // flip bytes near the end (tensor data): the digest check fails
    std::fstream f(baseline, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-16, std::ios::end);
    f.write("corruptcorrupt!!", 16);
  }
  const std::string stale = spec.persist_dir + "/baseline.safetensors.tmp-AbC123";
  { std::ofstream(stale) << "half-written"; }

  E2E_ASSERT_OK(pub.Start());
  absl::StatusOr<v1::StatusResponse> st = RpcStatus(pub.control_target());
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->baseline().state(), v1::BASELINE_STATE_MOVED_ASIDE) << st->DebugString();
  EXPECT_FALSE(st->baseline().load_error().empty());
  EXPECT_TRUE(fs::exists(st->baseline().moved_to())) << st->baseline().moved_to();
  EXPECT_TRUE(absl::StrContains(st->baseline().moved_to(), "baseline.corrupt-"));
  EXPECT_EQ(st->version(), 0u);
  EXPECT_FALSE(fs::exists(stale)) << "stale temporary file removed";
  EXPECT_TRUE(LogContains(pub, "REFUSED")) << pub.LogTail();
  EXPECT_TRUE(LogContains(pub, "baseline.safetensors.tmp-AbC123")) << pub.LogTail();
  CommandResult text = Refitctl(pub, {"status"});
  EXPECT_TRUE(absl::StrContains(text.out, "REFUSED AT START")) << text.Describe();
  CommandResult json = Refitctl(pub, {"status", "--json"});
  EXPECT_TRUE(absl::StrContains(json.out, "BASELINE_STATE_MOVED_ASIDE")) << json.Describe();

  // It serves: a new version publishes and persists (in the background: poll).
  E2E_ASSERT_OK(Publish(pub, SmallModel(2), 1));
  st = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& s) {
        return s.baseline().state() == v1::BASELINE_STATE_PERSISTED;
      },
      absl::Seconds(30), "version 1 persisted");
  ASSERT_THAT(st, IsOk());
}

TEST_F(E2ESecurityVersionsTest, SecondPublisherOnTheSamePersistDirIsRefused) {
  PublisherSpec spec;
  spec.persist_dir = Path("persist");
  DaemonProcess& first = NewPublisher(spec);
  E2E_ASSERT_OK(first.Start());
  spec.name = "pub2";
  DaemonProcess& second = NewPublisher(spec);
  absl::Status started = second.Start();
  ASSERT_THAT(started, Not(IsOk()));
  EXPECT_TRUE(absl::StrContains(started.message(), "in use by another publisher")) << started;
  EXPECT_TRUE(absl::StrContains(started.message(), spec.persist_dir)) << started;
}

TEST_F(E2ESecurityVersionsTest, FailedPersistShowsInStatus) {
  PublisherSpec spec;
  spec.persist_dir = Path("persist");
  DaemonProcess& pub = NewPublisher(spec);
  E2E_ASSERT_OK(pub.Start());
  // A directory where the baseline file goes: the rename of every persist fails (as root too).
  fs::create_directories(spec.persist_dir + "/baseline.safetensors/blocker");
  E2E_ASSERT_OK(Publish(pub, SmallModel(1), 1));
  // Persistence runs in the background: poll for its failure.
  absl::StatusOr<v1::StatusResponse> st = PollStatus(
      pub.control_target(),
      [](const v1::StatusResponse& s) {
        return s.baseline().state() == v1::BASELINE_STATE_PERSIST_FAILED;
      },
      absl::Seconds(30), "the persist of version 1 failed");
  ASSERT_THAT(st, IsOk());
  EXPECT_EQ(st->version(), 1u) << "served from memory";
  EXPECT_EQ(st->baseline().state(), v1::BASELINE_STATE_PERSIST_FAILED) << st->DebugString();
  EXPECT_FALSE(st->baseline().last_persist_error().empty());
  CommandResult text = Refitctl(pub, {"status"});
  EXPECT_TRUE(absl::StrContains(text.out, "PERSIST FAILED")) << text.Describe();
}

}  // namespace
}  // namespace refit::e2e

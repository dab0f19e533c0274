#include "tests/harness/e2e.h"

#include <poll.h>
#include <signal.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_matchers.h"

namespace refit::e2e {
namespace {

using ::refit::testing::IsOk;

void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

std::shared_ptr<grpc::Channel> PlainChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A fresh connection per helper call, so a restarted daemon is reached at once.
  args.SetInt("refit.e2e.unique", static_cast<int>(reinterpret_cast<uintptr_t>(&args) & 0x7FFFFFFF));
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

absl::StatusOr<v1::StatusResponse> RpcStatus(const std::string& target, absl::Duration timeout) {
  auto stub = v1::Control::NewStub(PlainChannel(target));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  v1::StatusResponse resp;
  absl::Status s = FromGrpcStatus(stub->Status(&ctx, v1::StatusRequest(), &resp));
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("Status on ", target, ": ", s.message()));
  return resp;
}

absl::StatusOr<v1::WaitVersionResponse> RpcWaitVersion(const std::string& target, uint64_t version,
                                                       absl::Duration timeout,
                                                       bool all_subscribers) {
  auto stub = v1::Control::NewStub(PlainChannel(target));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout + absl::Seconds(5));
  v1::WaitVersionRequest req;
  req.set_version(version);
  req.set_timeout_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(timeout)));
  req.set_all_subscribers(all_subscribers);
  v1::WaitVersionResponse resp;
  absl::Status s = FromGrpcStatus(stub->WaitVersion(&ctx, req, &resp));
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("WaitVersion(", version, ") on ", target, ": ",
                                               s.message()));
  }
  return resp;
}

absl::StatusOr<v1::VerifyResponse> RpcVerify(const std::string& target, absl::Duration timeout) {
  auto stub = v1::Control::NewStub(PlainChannel(target));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  v1::VerifyResponse resp;
  absl::Status s = FromGrpcStatus(stub->Verify(&ctx, v1::VerifyRequest(), &resp));
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("Verify on ", target, ": ", s.message()));
  return resp;
}

absl::StatusOr<v1::StatusResponse> PollStatus(
    const std::string& target, const std::function<bool(const v1::StatusResponse&)>& pred,
    absl::Duration timeout, const std::string& what) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::StatusResponse last;
  absl::Status last_error;
  for (;;) {
    absl::StatusOr<v1::StatusResponse> s = RpcStatus(target, absl::Seconds(5));
    if (s.ok()) {
      if (pred(*s)) return s;
      last = *s;
    } else {
      last_error = s.status();
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, " not reached on ", target, " within ", absl::FormatDuration(timeout),
          "; last status: ", last.ShortDebugString(),
          last_error.ok() ? "" : absl::StrCat("; last error: ", last_error.ToString())));
    }
    poll(nullptr, 0, 10);  // Status is the only signal for session states: poll with a deadline
  }
}

absl::StatusOr<v1::StatusResponse> StatusAfterRefit(const std::string& target, uint64_t version,
                                                    absl::Duration timeout) {
  return PollStatus(
      target,
      [version](const v1::StatusResponse& s) {
        return s.version() >= version && s.last_refit().version() >= version;
      },
      timeout, absl::StrCat("version ", version, " with its last_refit"));
}

std::string DescribeRefit(const v1::RefitStats& r) {
  return absl::StrFormat(
      "v%d<-v%d wire %d B of dense %d B (%.3f%%), changed %d/%d (%.3f%%), %d keyframe tensors, "
      "latency %.1f ms, verified %d",
      r.version(), r.base_version(), r.wire_bytes(), r.dense_bytes(),
      r.dense_bytes() ? 100.0 * static_cast<double>(r.wire_bytes()) / r.dense_bytes() : 0.0,
      r.changed_elements(), r.total_elements(), 100.0 * r.change_rate(), r.keyframe_tensors(),
      r.latency_micros() / 1000.0, r.digests_verified() ? 1 : 0);
}

class E2ETest::Watchdog {
 public:
  Watchdog(absl::Duration limit, std::function<void()> on_expire)
      : thread_([this, limit, on_expire = std::move(on_expire)] {
          absl::MutexLock lock(&mu_);
          if (!mu_.AwaitWithTimeout(absl::Condition(&done_), limit)) on_expire();
        }) {}
  ~Watchdog() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    thread_.join();
  }

 private:
  absl::Mutex mu_;
  bool done_ = false;
  std::thread thread_;
};

E2ETest::E2ETest() = default;
E2ETest::~E2ETest() = default;

void E2ETest::SetUp() {
  watchdog_ = std::make_unique<Watchdog>(kTestWatchdog, [this] {
    std::fprintf(stderr, "e2e watchdog: the test ran longer than %s; aborting\n",
                 absl::FormatDuration(kTestWatchdog).c_str());
    for (const auto& d : daemons_) {
      std::fprintf(stderr, "---- %s log tail ----\n%s", d->name().c_str(), d->LogTail(60).c_str());
      if (d->pid() > 0) kill(d->pid(), SIGKILL);
    }
    std::abort();
  });
  if (RefitdBin().empty() || RefitctlBin().empty()) {
    GTEST_SKIP() << "built without the refitd / refitctl targets";
  }
  char tmpl[] = "/tmp/refit-e2e-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr) << "mkdtemp " << tmpl;
  dir_ = tmpl;
  std::error_code ec;
  std::filesystem::create_directories(DefaultExportDir(dir_), ec);
  ASSERT_FALSE(ec) << "mkdir " << DefaultExportDir(dir_) << ": " << ec.message();
}

void E2ETest::TearDown() {
  const bool failed = HasFailure();
  if (failed) {
    for (const auto& d : daemons_) {
      std::fprintf(stderr, "---- %s (%s) log tail, %s ----\n%s", d->name().c_str(),
                   d->role().c_str(), d->log_path().c_str(), d->LogTail(60).c_str());
    }
  }
  // Subscribers first, then publishers, each by SIGTERM (a clean stop is part of the contract).
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& d : daemons_) {
      if ((d->role() == "subscriber") != (pass == 0)) continue;
      if (!d->running()) continue;
      absl::StatusOr<int> code = d->Terminate(absl::Seconds(20));
      EXPECT_THAT(code, IsOk()) << d->name() << " at teardown: " << code.status();
      if (code.ok()) {
        EXPECT_EQ(*code, 0) << d->name() << " exited with " << *code << " after SIGTERM\n"
                            << d->LogTail();
      }
    }
  }
  daemons_.clear();
  watchdog_.reset();
  if (dir_.empty()) return;
  if (failed || HasFailure()) {
    std::fprintf(stderr, "kept test directory %s\n", dir_.c_str());
  } else {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

DaemonProcess& E2ETest::NewPublisher(const PublisherSpec& spec) {
  daemons_.push_back(std::make_unique<DaemonProcess>("publisher", dir_, spec.name));
  DaemonProcess& d = *daemons_.back();
  d.set_config(PublisherYaml(spec, dir_, d.ready_path()));
  return d;
}

DaemonProcess& E2ETest::NewSubscriber(const SubscriberSpec& spec) {
  daemons_.push_back(std::make_unique<DaemonProcess>("subscriber", dir_, spec.name));
  DaemonProcess& d = *daemons_.back();
  d.set_config(SubscriberYaml(spec, dir_, d.ready_path()));
  return d;
}

absl::StatusOr<E2ETest::PubSub> E2ETest::StartPubSub(const std::string& subscriber,
                                                     const PublisherSpec& publisher) {
  DaemonProcess& pub = NewPublisher(publisher);
  REFIT_RETURN_IF_ERROR(pub.Start());
  SubscriberSpec ss;
  ss.name = subscriber;
  ss.upstream = {pub.listen_target()};
  DaemonProcess& sub = NewSubscriber(ss);
  REFIT_RETURN_IF_ERROR(sub.Start());
  return PubSub{&pub, &sub};
}

void E2ETest::Reconfigure(DaemonProcess& d, const PublisherSpec& spec) {
  d.set_config(PublisherYaml(spec, dir_, d.ready_path()));
}

void E2ETest::Reconfigure(DaemonProcess& d, const SubscriberSpec& spec) {
  d.set_config(SubscriberYaml(spec, dir_, d.ready_path()));
}

absl::StatusOr<std::string> E2ETest::WriteModelFile(const Model& model, const std::string& stem) {
  const std::string path = Path(stem + ".safetensors");
  absl::Status s = WriteModel(path, model);
  if (!s.ok()) return s;
  return path;
}

absl::Status E2ETest::Publish(const DaemonProcess& pub, const Model& model, uint64_t version) {
  absl::StatusOr<std::string> path = WriteModelFile(model, absl::StrCat(pub.name(), "-v", version));
  if (!path.ok()) return path.status();
  CommandResult r = RunRefitctl({"--target", pub.control_target(), "publish", "--safetensors",
                                 *path, "--version", absl::StrCat(version)});
  if (r.exit_code != 0) {
    return absl::InternalError(absl::StrCat("refitctl publish v", version, " to ", pub.name(),
                                            ": ", r.Describe()));
  }
  return absl::OkStatus();
}

absl::Status E2ETest::WaitVersion(const DaemonProcess& d, uint64_t version, absl::Duration timeout,
                                  bool all_subscribers) {
  std::vector<std::string> args{"--target", d.control_target(), "wait", "--version",
                                absl::StrCat(version), "--timeout",
                                absl::StrCat(absl::ToInt64Seconds(timeout))};
  if (all_subscribers) args.push_back("--all-subscribers");
  CommandResult r = RunRefitctl(args, timeout + absl::Seconds(30));
  if (r.exit_code != 0) {
    return absl::DeadlineExceededError(absl::StrCat("refitctl wait --version ", version, " on ",
                                                    d.name(), ": ", r.Describe()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Model> E2ETest::Export(const DaemonProcess& d, std::optional<uint64_t> version) {
  const std::string path = absl::StrCat(DefaultExportDir(dir_), "/", d.name(), "-export-",
                                        exports_++, ".safetensors");
  std::vector<std::string> args{"--target", d.control_target(), "export", "--safetensors", path};
  if (version) {
    args.push_back("--version");
    args.push_back(absl::StrCat(*version));
  }
  CommandResult r = RunRefitctl(args);
  if (r.exit_code != 0) {
    return absl::InternalError(absl::StrCat("refitctl export on ", d.name(), ": ", r.Describe()));
  }
  absl::StatusOr<Model> m = ReadModel(path);
  std::error_code ec;
  std::filesystem::remove(path, ec);
  if (!m.ok()) {
    return absl::Status(m.status().code(),
                        absl::StrCat("export of ", d.name(), " unreadable: ", m.status().message()));
  }
  return m;
}

absl::Status E2ETest::ExpectExportEquals(const DaemonProcess& d, const Model& expected,
                                         std::optional<uint64_t> version) {
  absl::StatusOr<Model> got = Export(d, version);
  if (!got.ok()) return got.status();
  // The export holds the tensors in name order.
  for (size_t i = 1; i < got->tensors.size(); ++i) {
    if (!(got->tensors[i - 1].name < got->tensors[i].name)) {
      return absl::InternalError(absl::StrCat("export of ", d.name(), " is not in name order at '",
                                              got->tensors[i].name, "'"));
    }
  }
  const std::string diff = DiffModels(expected, *got);
  if (!diff.empty()) {
    return absl::InternalError(absl::StrCat("export of ", d.name(),
                                            version ? absl::StrCat(" (v", *version, ")") : "",
                                            " differs from the published model:\n", diff));
  }
  return absl::OkStatus();
}

absl::Status E2ETest::ExpectHolds(const DaemonProcess& d, const Model& m, uint64_t v) {
  if (absl::Status st = WaitVersion(d, v); !st.ok()) return st;
  if (absl::Status st = ExpectExportEquals(d, m); !st.ok()) return st;
  return ExpectVerified(d);
}

absl::Status E2ETest::ExpectVerified(const DaemonProcess& d) {
  CommandResult r = RunRefitctl({"--target", d.control_target(), "verify"});
  if (r.exit_code != 0) {
    return absl::InternalError(absl::StrCat("refitctl verify on ", d.name(), ": ", r.Describe()));
  }
  absl::StatusOr<v1::VerifyResponse> v = RpcVerify(d.control_target());
  if (!v.ok()) return v.status();
  if (!v->ok()) {
    return absl::InternalError(absl::StrCat("Verify on ", d.name(), " not ok: ", v->ShortDebugString()));
  }
  return absl::OkStatus();
}

}  // namespace refit::e2e

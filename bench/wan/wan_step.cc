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
//
// Sharded versions (docs/ARCHITECTURE.md "Sharded versions"): --shard CONTROL=TRAINER_SOCKET once
// per shard publisher, in shard index order, instead of --publisher/--trainer-socket. Tensor i
// of FILE (file order) belongs to shard i % K; each shard's trainer registers its tensors in its
// own memfd, and one command publishes the same version on all K at once (the clock runs from
// the first call to the last answer). The line then also holds "publishers_status" (one per
// shard; "publisher_status" is shard 0's).
//
// Every line holds "expected": the version digests (v1 and v2) of all of FILE's tensors, computed
// here (outside the clock) from the file itself: what a subscriber of the whole model, sharded
// or not, must report. --selected-patch-bytes PATTERNS (comma-separated names or globs, as
// subscriber.upstream.tensors; repeatable) adds "selected_patch_bytes": per PATTERNS, the bytes
// of the patches (codec defaults) of the selected tensors that changed since the previous
// command's FILE (0 for the first): what a subscriber with that selection must receive.
//   wan_step (--publisher ADDR [--trainer-socket PATH] | --shard ADDR=PATH...)
//            --subscriber ADDR [--subscriber ADDR]...
//            [--publish-via trainer_api|control] [--selected-patch-bytes PATTERNS]... [--timeout S]
// Exit 0 at the end of stdin; 1 when a call fails (the error on stderr); 2 on bad arguments.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/refitctl.h"
#include "client/trainer_client.h"
#include "daemon/codec/codec.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/selection.h"
#include "daemon/sync/version_digest.h"
#include "google/protobuf/util/json_util.h"
#include "refit/v1/control.grpc.pb.h"

namespace {

namespace v1 = refit::v1;

// One publisher: its Control and (trainer_api) its TrainerApi socket.
struct PublisherAddr {
  std::string control, trainer_socket;
};

struct Args {
  std::vector<PublisherAddr> publishers;  // one, or one per shard (index order)
  bool sharded = false;
  std::string via = "trainer_api";
  std::vector<std::string> subscribers;
  std::vector<refit::sync::TensorSelection> selections;  // --selected-patch-bytes
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

refit::sync::TensorSelection ParseSelection(const std::string& arg) {
  std::vector<std::string> patterns = absl::StrSplit(arg, ',', absl::SkipEmpty());
  absl::StatusOr<refit::sync::TensorSelection> sel =
      refit::sync::TensorSelection::Make(std::move(patterns), "--selected-patch-bytes");
  if (!sel.ok()) Usage(std::string(sel.status().message()));
  if (sel->all()) Usage("--selected-patch-bytes: no pattern");
  return *std::move(sel);
}

PublisherAddr ParseShard(const std::string& arg) {
  const std::vector<std::string> parts = absl::StrSplit(arg, absl::MaxSplits('=', 1));
  if (parts.size() != 2 || parts[0].empty() || parts[1].empty()) {
    Usage(absl::StrCat("--shard ", arg, ": expected CONTROL=TRAINER_SOCKET"));
  }
  return {parts[0], parts[1]};
}

void CheckArgs(const Args& a, const std::string& publisher, const std::string& trainer_socket) {
  if (a.sharded && (!publisher.empty() || !trainer_socket.empty())) {
    Usage("--shard replaces --publisher and --trainer-socket: give one or the other");
  }
  if (a.publishers.empty() || a.subscribers.empty()) {
    Usage("--publisher (or --shard) and --subscriber are required");
  }
  if (a.via != "trainer_api" && a.via != "control") {
    Usage(absl::StrCat("--publish-via ", a.via, ": trainer_api or control"));
  }
  if (a.via == "trainer_api" && a.publishers[0].trainer_socket.empty()) {
    Usage("--publish-via trainer_api needs --trainer-socket (the publisher's local_socket)");
  }
  if (a.sharded && a.via != "trainer_api") {
    Usage("--shard publishes through each shard's TrainerApi: --publish-via trainer_api");
  }
}

Args Parse(int argc, char** argv) {
  Args a;
  std::string publisher, trainer_socket;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has = i + 1 < argc;
    if (k == "--publisher" && has) publisher = argv[++i];
    else if (k == "--shard" && has) a.publishers.push_back(ParseShard(argv[++i]));
    else if (k == "--subscriber" && has) a.subscribers.push_back(argv[++i]);
    else if (k == "--publish-via" && has) a.via = argv[++i];
    else if (k == "--trainer-socket" && has) trainer_socket = argv[++i];
    else if (k == "--selected-patch-bytes" && has)
      a.selections.push_back(ParseSelection(argv[++i]));
    else if (k == "--timeout" && has) a.timeout_s = std::atof(argv[++i]);
    else Usage(absl::StrCat("bad argument ", k));
  }
  a.sharded = !a.publishers.empty();
  if (!a.sharded && !publisher.empty()) a.publishers.push_back({publisher, trainer_socket});
  CheckArgs(a, publisher, trainer_socket);
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

// The wire spec of a file's tensor.
v1::TensorSpec SpecOf(const refit::model::SafetensorsEntry& e) {
  v1::TensorSpec s;
  s.set_name(e.name);
  s.set_dtype(refit::sync::ToProtoDType(e.dtype));
  for (int64_t d : e.shape) s.add_shape(static_cast<uint64_t>(d));
  return s;
}

// The trainer's side of the TrainerApi path: one memfd registered at the first file, holding the
// tensors this shard owns (file index i with i % count == index; every tensor unsharded).
class Trainer {
 public:
  Trainer(std::string socket, size_t index, size_t count)
      : socket_(std::move(socket)), index_(index), count_(count) {}

  // Copies the owned tensors of `f` (read from `file`) into the memfd, creating and registering
  // it on the first call.
  absl::Status Load(const refit::model::SafetensorsFile& f, const std::string& file) {
    const std::vector<size_t> owned = Owned(f);
    if (owned.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(file, " has ", f.tensors().size(),
                                                     " tensors: none for shard ", index_, " of ",
                                                     count_));
    }
    if (client_ == nullptr) REFIT_RETURN_IF_ERROR(Register(f, owned));
    if (owned.size() != client_->num_tensors()) {
      return absl::FailedPreconditionError(
          absl::StrCat(file, " holds ", owned.size(), " tensors for shard ", index_,
                       "; the registered memfd ", client_->num_tensors()));
    }
    for (size_t j = 0; j < owned.size(); ++j) {
      const size_t i = owned[j];
      const std::span<uint8_t> dst = client_->tensor(j);
      if (f.tensors()[i].name != client_->spec(j).name() || f.data(i).size() != dst.size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            file, ": tensor ", i, " \"", f.tensors()[i].name, "\" (", f.data(i).size(),
            " bytes) is not the registered \"", client_->spec(j).name(), "\" (", dst.size(),
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
  std::vector<size_t> Owned(const refit::model::SafetensorsFile& f) const {
    std::vector<size_t> out;
    for (size_t i = index_; i < f.tensors().size(); i += count_) out.push_back(i);
    return out;
  }

  absl::Status Register(const refit::model::SafetensorsFile& f, const std::vector<size_t>& owned) {
    std::vector<v1::TensorSpec> specs;
    for (size_t i : owned) specs.push_back(SpecOf(f.tensors()[i]));
    REFIT_ASSIGN_OR_RETURN(client_, refit::client::TrainerClient::Create(
                                        socket_, absl::StrCat("wan-trainer-", index_), specs));
    return client_->Register().status();
  }

  std::string socket_;
  size_t index_ = 0, count_ = 1;
  std::unique_ptr<refit::client::TrainerClient> client_;
};

// What every subscriber of the whole model must report for a version (computed from the file):
// its version digests in both formats.
struct Expected {
  uint64_t version_digest = 0, version_digest_v2 = 0;
};

// The version digest in `format` of all of f's tensors (common.proto: name order).
absl::StatusOr<uint64_t> VersionDigestOf(const refit::model::SafetensorsFile& f,
                                         refit::sync::DigestFormat format) {
  std::vector<v1::TensorSpec> manifest;
  std::vector<uint64_t> digests;
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    manifest.push_back(SpecOf(f.tensors()[i]));
    digests.push_back(refit::sync::TensorDigestOf(format, f.data(i)));
  }
  refit::sync::SortManifest(manifest, &digests);
  return refit::sync::VersionDigest(manifest, digests);
}

absl::StatusOr<Expected> ExpectedOf(const refit::model::SafetensorsFile& f) {
  Expected out;
  REFIT_ASSIGN_OR_RETURN(out.version_digest, VersionDigestOf(f, refit::sync::DigestFormat::kV1));
  REFIT_ASSIGN_OR_RETURN(out.version_digest_v2, VersionDigestOf(f, refit::sync::DigestFormat::kV2));
  return out;
}

// `data`, or a copy of it in `copies` when it does not start on an 8-byte boundary (the
// encoder needs element-aligned buffers; a safetensors file does not promise them).
std::span<const uint8_t> Aligned(std::span<const uint8_t> data,
                                 std::deque<std::vector<uint8_t>>* copies) {
  if (reinterpret_cast<uintptr_t>(data.data()) % 8 == 0) return data;
  copies->emplace_back(data.begin(), data.end());
  return copies->back();
}

// Bytes of the patches (codec defaults) of the tensors `sel` selects that differ between `base`
// and `target` (the same tensors, in the same order: checked).
absl::StatusOr<uint64_t> SelectedPatchBytes(const refit::model::SafetensorsFile& base,
                                            const refit::model::SafetensorsFile& target,
                                            const refit::sync::TensorSelection& sel) {
  if (base.tensors().size() != target.tensors().size()) {
    return absl::FailedPreconditionError("the versions hold different tensors");
  }
  std::vector<refit::EncodeInput> inputs;
  std::deque<std::vector<uint8_t>> copies;  // of tensors the file does not hold aligned
  for (size_t i = 0; i < target.tensors().size(); ++i) {
    const refit::model::SafetensorsEntry& e = target.tensors()[i];
    if (!sel.Matches(e.name)) continue;
    if (base.tensors()[i].name != e.name || base.data(i).size() != target.data(i).size()) {
      return absl::FailedPreconditionError(absl::StrCat("tensor ", i, " \"", e.name,
                                                        "\" differs in name or size"));
    }
    if (std::memcmp(base.data(i).data(), target.data(i).data(), target.data(i).size()) == 0) {
      continue;  // UNCHANGED: no patch
    }
    inputs.push_back({e.dtype, Aligned(base.data(i), &copies), Aligned(target.data(i), &copies)});
  }
  REFIT_ASSIGN_OR_RETURN(const std::vector<std::vector<uint8_t>> patches,
                         refit::EncodePatches(inputs));
  uint64_t bytes = 0;
  for (const std::vector<uint8_t>& p : patches) bytes += p.size();
  return bytes;
}

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

// Publishes c.version on every trainer at once (one thread each): t0 before the first call, t1
// after the last answer; the first failure is the status.
Published TrainerPublish(const Command& c, std::vector<Trainer>& trainers) {
  std::vector<absl::StatusOr<v1::LocalPublishResponse>> r(trainers.size(),
                                                         absl::UnknownError("not called"));
  Published p;
  p.t0 = NowNs();
  std::vector<std::thread> threads;
  for (size_t k = 0; k < trainers.size(); ++k) {
    threads.emplace_back([&, k] { r[k] = trainers[k].Publish(c.version); });
  }
  for (std::thread& t : threads) t.join();
  p.t1 = NowNs();
  for (size_t k = 0; k < r.size() && p.status.ok(); ++k) {
    const std::string who = trainers.size() > 1 ? absl::StrCat(" (shard ", k, ")") : "";
    p.status = r[k].status();
    if (r[k].ok() && (!r[k]->committed() || r[k]->version() != c.version)) {
      p.status = absl::InternalError(absl::StrCat("TrainerApi Publish of version ", c.version, who,
                                                  " answered version ", r[k]->version(),
                                                  ", committed ",
                                                  r[k]->committed() ? "true" : "false"));
    } else if (!p.status.ok()) {
      p.status = absl::Status(p.status.code(), absl::StrCat(p.status.message(), who));
    }
  }
  if (p.status.ok()) p.json = Json(*r[0]);
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

// What a command adds to its line besides the calls: the expected digests and selected bytes.
struct Facts {
  double load_ms = 0;
  Expected expected;
  std::vector<uint64_t> selected_patch_bytes;
};

std::string Report(const Args& a, const Command& c, const Facts& facts, const Published& p,
                   const std::vector<Wait>& waits,
                   const std::vector<std::unique_ptr<v1::Control::Stub>>& pubs,
                   const std::vector<std::unique_ptr<v1::Control::Stub>>& subs) {
  std::string out = absl::StrCat(
      "{\"publish_via\": \"", a.via, "\", \"shards\": ", a.sharded ? pubs.size() : 0,
      ", \"load_ms\": ", facts.load_ms, ", \"publish_start_unix_ns\": ", p.t0,
      ", \"publish_return_unix_ns\": ", p.t1, ", \"publish\": ", p.json,
      ", \"expected\": {\"version_digest\": \"", facts.expected.version_digest,
      "\", \"version_digest_v2\": \"", facts.expected.version_digest_v2,
      "\"}, \"selected_patch_bytes\": [");
  for (size_t i = 0; i < facts.selected_patch_bytes.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", facts.selected_patch_bytes[i]);
  }
  absl::StrAppend(&out, "], \"waits\": [");
  for (size_t i = 0; i < waits.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", "{\"end_unix_ns\": ", waits[i].end_unix_ns,
                    ", \"response\": ", Json(waits[i].response), "}");
  }
  std::vector<std::string> pub_status;
  for (size_t k = 0; k < pubs.size(); ++k) {
    pub_status.push_back(Json(Status(pubs[k].get(), absl::StrCat("publisher ", k))));
  }
  absl::StrAppend(&out, "], \"publisher_status\": ", pub_status[0], ", \"publishers_status\": [",
                  absl::StrJoin(pub_status, ", "), "], \"subscriber_status\": [");
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

// The state kept across commands: the files (the previous one is the base of the selected
// patch bytes) and the trainers.
struct Session {
  std::vector<Trainer> trainers;
  std::optional<refit::model::SafetensorsFile> previous;
};

// Reads the command's file, loads the trainers (trainer_api) and computes the facts; all of it
// before the clock starts.
Facts Prepare(const Args& a, const Command& c, Session* s) {
  const auto l0 = std::chrono::steady_clock::now();
  absl::StatusOr<refit::model::SafetensorsFile> f = refit::model::SafetensorsFile::Open(c.file);
  if (!f.ok()) Fail(absl::StrCat("reading ", c.file), f.status());
  for (size_t k = 0; a.via == "trainer_api" && k < s->trainers.size(); ++k) {
    if (absl::Status st = s->trainers[k].Load(*f, c.file); !st.ok()) {
      Fail(absl::StrCat("loading the memfd of publisher ", k), st);
    }
  }
  Facts facts;
  facts.load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - l0).count();
  absl::StatusOr<Expected> e = ExpectedOf(*f);
  if (!e.ok()) Fail(absl::StrCat("digests of ", c.file), e.status());
  facts.expected = *e;
  for (const refit::sync::TensorSelection& sel : a.selections) {
    absl::StatusOr<uint64_t> b = s->previous ? SelectedPatchBytes(*s->previous, *f, sel) : 0;
    if (!b.ok()) Fail(absl::StrCat(c.file, ": patches of ", sel.Describe()), b.status());
    facts.selected_patch_bytes.push_back(*b);
  }
  s->previous = *std::move(f);
  return facts;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  std::vector<std::unique_ptr<v1::Control::Stub>> pubs, subs;
  Session session;
  for (size_t k = 0; k < a.publishers.size(); ++k) {
    pubs.push_back(Stub(a.publishers[k].control));
    session.trainers.emplace_back(a.publishers[k].trainer_socket, k, a.publishers.size());
  }
  for (const std::string& s : a.subscribers) subs.push_back(Stub(s));
  Command c;
  while (ReadCommand(&c)) {
    const Facts facts = Prepare(a, c, &session);
    std::function<Published()> publish = [&] { return ControlPublish(a, c, pubs[0].get()); };
    if (a.via == "trainer_api") publish = [&] { return TrainerPublish(c, session.trainers); };
    Published p;
    const std::vector<Wait> waits = PublishAndWait(a, c.version, subs, publish, &p);
    const std::string out = Report(a, c, facts, p, waits, pubs, subs);
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }
  return 0;
}

// The publisher's core, without any RPC: takes snapshots of new versions, encodes them against
// the previous baseline, keeps a bounded history of patches (sync::PatchHistory), produces the
// frames of a transfer to a subscriber at any version, and optionally persists its baseline so a
// restarted publisher can still serve deltas. The DataPlane gRPC server wraps this class.
//
// Encoding runs on the CPU codec (daemon/codec) or, with PublisherOptions::device (config
// codec.device cuda, or auto with a GPU), on GPUs with cuda::Device::Encode / Digest; the patches
// are byte-identical either way (the codec's contract), so subscribers and the wire format do not
// depend on where the publisher encodes. See "GPU encoding" at PublisherCore for the memory held
// in each mode.
#ifndef REFIT_DAEMON_SERVING_PUBLISHER_CORE_H_
#define REFIT_DAEMON_SERVING_PUBLISHER_CORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cuda/device.h"
#include "daemon/codec/dtype.h"
#include "daemon/serving/format_chooser.h"
#include "daemon/serving/live_listener.h"
#include "daemon/serving/live_version.h"
#include "daemon/serving/persist_dir.h"
#include "daemon/serving/publish_guard.h"
#include "daemon/serving/tensor_cut.h"
#include "daemon/serving/tensor_place.h"
#include "daemon/serving/transfer.h"
#include "daemon/sync/frames.h"
#include "daemon/sync/history.h"
#include "refit/v1/control.pb.h"
#include "refit/v1/data.pb.h"

namespace refit::publisher {

// A tensor's bytes in daemon-owned memory a cuda::Device reads: its device memory or pinned,
// mapped host memory (memory.kind()). A TrainerApi snapshot of a trainer's CUDA tensor, or a
// tensor of the core's GPU baseline. Immutable once handed to Publish.
// The config field that confines Control file publish (named in its errors).
inline constexpr char kPublishDirsField[] = "publisher.files.publish_dirs";

struct DeviceBytes {
  cuda::Device* device = nullptr;  // must outlive this
  cuda::Allocation memory;         // memory.size() = the tensor's bytes
};

// One tensor of a version to publish. `data` must hold product(shape) * DTypeSize(dtype) bytes
// (little-endian elements) and stay valid and unmodified until Publish returns: Publish reads it
// (the CPU codec's one pass compares, encodes and digests it against the baseline in one read,
// then patches the baseline's changed elements; only new tensors, reshaped ones and tensors a
// transfer in flight still holds are copied), so the caller may modify it once Publish returns.
struct TensorInput {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;  // empty for a scalar
  // Set for a part of a larger tensor (TensorSpec.part: a shard publisher's rows of it, or one of
  // the parts PublisherOptions::cut makes; `shape` is the part's). Encoded, digested, kept and
  // persisted like any tensor of `shape`, keyed by its place (name, part dim, first index).
  std::optional<v1::TensorPart> part = std::nullopt;
  std::span<const uint8_t> data;
  // Optional: a buffer holding exactly `data` that the caller hands over. Where Publish would
  // copy `data` it keeps this buffer instead (the caller must not modify it afterwards).
  std::shared_ptr<const std::vector<uint8_t>> owned;
  // Instead of `data` (which is then empty): the snapshot in device or pinned memory, of exactly
  // the tensor's size. With GPU encoding it is encoded on its own device and becomes that
  // tensor's GPU baseline (no copy); with the CPU codec Publish copies it to host memory first.
  std::shared_ptr<const DeviceBytes> device_bytes;
};

// GPU encoding: tensors on their devices (or pinned), by place.
using GpuBaselineMap = std::map<TensorPlace, std::shared_ptr<const DeviceBytes>>;

struct PublisherOptions {
  // Memory budget of the patch history (sync::PatchHistory); the newest version is always kept.
  uint64_t history_budget_bytes = 1ull << 30;
  // Versions the history keeps at most (config history.max_versions; >= 1).
  uint32_t history_max_versions = 64;
  // Codec block size (config codec.block_log2).
  int block_log2 = 18;
  // Patch format written (config codec.patch_format): 1, or 2 (EncodeOptions::format: context
  // coded blocks where smaller; the CPU codec and, with `device`, the GPU's). The history then
  // holds format-2 patches, and only sessions whose Hello lists format 2 are served.
  int patch_format = 1;
  // codec.patch_format auto (patch_format is then ignored): each version
  // is encoded in the format a FormatChooser picks from the measured refit latencies (fed by
  // NoteRefitLatency); sessions must list format 2, as with patch_format 2.
  bool patch_format_auto = false;
  FormatChooserOptions format_chooser;
  // Encoder threads (0 = one per hardware thread) and block size.
  int encode_threads = 0;
  // Threads for tensor digests (0 = all hardware threads).
  int digest_threads = 0;
  // Directory for the persisted baseline ("" = no persistence). Created if missing.
  std::string persist_dir;
  // fsync the persisted baseline and its directory, and every patch log record (config
  // baseline.fsync).
  bool persist_fsync = true;
  // Patch log bounds and the persister's queue (config baseline.*; BaselinePersister).
  uint32_t compact_log_versions = 64;
  uint64_t compact_log_bytes = 1ull << 30;
  uint32_t persist_max_queued_versions = 8;
  uint64_t persist_max_queued_bytes = 1ull << 30;
  // Test gate: the persister's thread calls it before every write with the version it is about
  // to persist (it may block; tests hold persistence there). Null: none.
  std::function<void(uint64_t version)> persist_hook;
  // Without persist_dir: the lineage (data.proto "Versions and lineage"); 0 = a random one.
  // With persist_dir the lineage comes from there (or is new when no baseline is persisted).
  uint64_t lineage = 0;
  // GPU encoding (config codec.device cuda, or auto with a usable GPU): host tensors are
  // uploaded to this device and every tensor is encoded and digested by its device's kernels.
  // Null: the CPU codec. Must outlive the core.
  cuda::Device* device = nullptr;
  // Where the GPU baseline of host tensors lives (config codec.gpu_baseline): device memory of
  // `device`, or pinned host memory the kernels read over the bus. Tensors handed over as
  // DeviceBytes keep the memory kind they come in.
  cuda::Allocation::Kind gpu_baseline = cuda::Allocation::Kind::kDevice;
  // Degenerate versions are refused (config publisher.publish_guard; see publish_guard.h).
  PublishGuardOptions publish_guard;
  // Tensor-parallel cuts (config publisher.cut; tensor_cut.h): Publish replaces every matched
  // input by its parts before anything else, so each part is a tensor of the version (its own
  // delta, digest and persisted entry). parts 0: none.
  CutOptions cut;
  // CPU codec: the one pass per version (PublisherCore "CPU one pass"). false: the copying path
  // (memcmp, snapshot copy, digest, encode: four reads), kept for benchmarks (publish_bench).
  bool cpu_one_pass = true;
  // CPU one pass: a changed tensor's baseline buffer that the core alone holds when the pass
  // starts is brought to the new bytes by the encoder's scan, block by block while the block is
  // in cache (EncodeInput::update_base), instead of at the commit. false: at the commit.
  bool update_baseline_in_pass = true;
  // Streamed transfers (LiveVersion; only the CPU one pass streams): the pass encodes the tensors
  // in manifest order in batches of about this many target bytes and hands each batch's objects to
  // the live version as soon as the batch is done (0: one batch, i.e. nothing leaves before the
  // whole pass).
  uint64_t stream_batch_bytes = 16ull << 20;
  // Streamed versions (on a base with v2 digests): the pass leaves the changed tensors' v1
  // digests out (about a third of its work) and computes them from the caller's bytes once the
  // v2 End is out: v2 sessions end without waiting for them, v1 sessions get their End after.
  // false: v1 in the pass, one End for both (what publish_bench compares against).
  bool v1_after_end = true;
  // v1 digests only once a session verifies v1: until a v1 session is first admitted
  // (NeedV1Digests: the newest version's are computed then, and every later version's eagerly)
  // a published version's changed tensors (CPU one pass, streamed: StreamPass::defer_v1) and a
  // relayed version adopted from a v2 upstream (AdoptRelayed) leave theirs pending instead of
  // reading the changed tensors again; unchanged tensors carry their base's state, judged
  // unchanged by digest v2 (sync::SameDigests). Subscribers that verify v2 never need them. With
  // persist_dir such versions are logged with their v2 digests (patch log record version 3) and
  // a compaction computes the v1 digests the baseline file records. The publisher daemon and a
  // relay's peer core set it.
  bool lazy_v1_digests = false;
  // Test gate: called on the publishing thread before each batch of a streamed pass with the
  // manifest-order indices [first, end) of its tensors (it may block); an error fails the publish
  // there (fault injection). Null: none.
  std::function<absl::Status(size_t first, size_t end)> stream_batch_hook;
};

// What Publish did (one log line per refit).
struct PublishSummary {
  uint64_t version = 0;
  uint64_t version_digest = 0;     // v1 (0 until the deferred v1 digests are recorded)
  uint64_t version_digest_v2 = 0;  // v2: the version's identity (Control, Status.digest_format)
  size_t tensors = 0;              // the version's tensors, each part counted (after cuts)
  size_t unchanged_tensors = 0;   // same spec and bytes as the previous version
  size_t patched_tensors = 0;     // encoded against the previous version
  size_t keyframe_tensors = 0;    // added, or dtype/shape changed (or the first version)
  size_t removed_tensors = 0;     // in the previous version, not in this one
  uint64_t changed_elements = 0;  // encoder counts + every element of keyframe tensors
  uint64_t total_elements = 0;
  // What a subscriber at the previous version receives: patch bytes + dense bytes of the
  // keyframe tensors (before LZ4); and the dense size of the whole version.
  uint64_t wire_bytes = 0;
  uint64_t dense_bytes = 0;
  uint64_t encode_micros = 0;  // EncodePatches, or the sum of the Device::Encode calls
  int patch_format = 1;        // the format the patches were encoded in (EncodeOptions::format)
  uint64_t digest_micros = 0;  // tensor digests (one pass: keyframe tensors only)
  uint64_t digest_cpu_micros = 0;
  // CPU one pass: the read of (baseline, new bytes) that compared, encoded and digested every
  // tensor with a base (also counted in encode_micros), then the baseline update: changed
  // elements patched in place (baseline_in_place_tensors) or copy-on-write of a tensor something
  // else still references (baseline_copied_tensors).
  uint64_t pass_micros = 0;
  uint64_t baseline_update_micros = 0;
  // The process's CPU time (every thread) over the pass and the baseline update.
  uint64_t pass_cpu_micros = 0;
  uint64_t baseline_update_cpu_micros = 0;
  size_t baseline_in_place_tensors = 0;
  size_t baseline_copied_tensors = 0;
  // AdoptRelayed: changed tensors whose received patches were kept for later instead of applied
  // (BaselineTensor::deferred_patches).
  size_t baseline_deferred_tensors = 0;
  // Where the patches were encoded: "" = the CPU codec; else the Describe() of every device that
  // encoded or digested a tensor ("; "-separated).
  std::string encode_device;
  uint64_t upload_micros = 0;    // GPU encoding: host tensors (and missing bases) to the device
  uint64_t download_micros = 0;  // device snapshots of changed tensors to host bytes
  // Persistence is asynchronous (BaselinePersister): Publish only queues the version's patch
  // log record, so persist_micros is that hand-over and persist_status is OK; a failed write
  // shows in baseline_status() and the "persist" log.
  uint64_t persist_micros = 0;
  absl::Status persist_status;
  uint64_t total_micros = 0;  // whole Publish
  // The process's CPU time over the whole Publish (every thread: sends to sessions meanwhile
  // included); the publish queue adds the reading of the input files.
  uint64_t cpu_micros = 0;
  uint64_t snapshot_unix_nanos = 0;
};

// A tensor of the baseline (the newest published version), shared with transfers in flight.
// The bytes a holder of `bytes` sees never change: the CPU one pass patches a baseline buffer in
// place only while the core's baseline is its sole owner (copy-on-write otherwise), so anyone
// who reads the bytes must hold the shared_ptr while reading.
struct BaselineTensor {
  v1::TensorSpec spec;
  DType dtype = DType::kBF16;
  uint64_t digest = 0;     // tensor digest v1 (TensorDigest)
  uint64_t digest_v2 = 0;  // tensor digest v2 (TensorDigestV2) of the same bytes
  // `digest` not computed yet (PublisherOptions::lazy_v1_digests; 0 meanwhile).
  bool digest_pending = false;
  std::shared_ptr<const std::vector<uint8_t>> bytes;
  // A relayed version adopted without applying its patches (PublisherCore::AdoptRelayed):
  // `bytes` still hold an older version's (digest v2 `deferred_base_digest_v2`), and
  // `deferred_patches`, applied in order, bring them to this version's. PublisherCore applies
  // them (MaterializeBaselineLocked) before anything reads `bytes`. `deferred_failed`: they did
  // not give this version's digest (`bytes` unusable until a version's bytes replace them).
  std::vector<std::shared_ptr<const std::vector<uint8_t>>> deferred_patches;
  uint64_t deferred_patch_bytes = 0;
  uint64_t deferred_base_digest_v2 = 0;
  bool deferred_failed = false;

  sync::DigestState digests() const { return {digest, digest_pending, digest_v2}; }
  bool deferred() const { return !deferred_patches.empty() || deferred_failed; }
  // `bytes` are this version's again.
  void ClearDeferred() {
    deferred_patches.clear();
    deferred_patch_bytes = 0;
    deferred_base_digest_v2 = 0;
    deferred_failed = false;
  }
};

// Thread-safe. Publish calls are serialised among themselves; Transfer and the accessors run
// concurrently with a Publish (they see the version before or after it, never a mix).
//
// GPU encoding (options.device set). Every tensor is encoded on a device: a DeviceBytes input on
// its own device, a host input on options.device (uploaded into an allocation of kind
// options.gpu_baseline). The base of the encode is the tensor's GPU baseline (the previous
// version's bytes on that device, or in pinned memory, which any device reads); when there is
// none (first GPU publish after a reload, device changed, a failed publish dropped it) the
// previous host bytes are uploaded for that call. The encode is the one pass
// Device::EncodeFused: the patch, the target's digest v2 (BaselineTensor::digest_v2) and, when
// the publisher holds that GPU baseline alone, the baseline brought up to the target in place by
// the changed elements (kept as the next baseline; otherwise the snapshot becomes it). A changed
// tensor's v1 digest comes from Device::Digest and its host bytes (keyframes for new subscribers,
// persistence) from one D2H copy of its snapshot, done here, i.e. after the TrainerApi has answered
// the trainer. An unchanged tensor (host input: memcmp; device input: the encoder finds no changed
// element) reuses the previous host bytes and digest. Memory, with M = one copy of the model:
//   GPU baseline device: steady state M of device memory (per GPU, for the tensors it holds) plus
//     the codec's scratch; the host keeps M (the baseline bytes, shared with transfers in flight)
//     plus the patch history. During a Publish the new snapshot (M, taken by the caller) exists
//     next to the baseline; each previous baseline tensor is freed as soon as its successor is
//     encoded, so GPU memory peaks at 2M (M + one tensor for host inputs, which are uploaded
//     tensor by tensor), and the host at 2M (the previous baseline lives on while transfers use
//     it).
//   GPU baseline pinned: the same with pinned host memory in place of device memory (no device
//     memory beyond the scratch): pinned M steady (2M peak) plus host M.
//   CPU codec: host M steady; during a Publish M plus the caller's buffers (the one pass reads
//     them, copies only new or reshaped tensors and tensors still held by transfers in flight).
//
// CPU one pass (options.cpu_one_pass, the default). Every tensor with the same spec as before is
// read once together with its baseline bytes by EncodePatchesWithChanges: the encoder's scan
// finds the changed elements, writes the patch, logs each change and the digest-v2 delta, and
// hashes the new bytes (digest v1; a streamed version leaves that to after its End,
// v1_after_end) while they are in cache; a tensor with no changed element is unchanged (no
// memcmp). There is no snapshot copy: at the commit (after the history and the streamed End),
// under the lock MakeTransfer copies the baseline under, each changed tensor's baseline buffer
// gets its logged changes written in place (O(changed), no decode) when the baseline is its only
// owner; when a transfer in flight (a keyframe for a late joiner), a Baseline() caller or the
// persistence still holds it, the tensor gets a new buffer copied from the caller's bytes
// (copy-on-write), so every holder keeps seeing the version it took. With
// update_baseline_in_pass (the default) the buffers the core alone holds when the pass starts
// are written by the pass itself, each block right after it is encoded; until the commit nothing
// may read them: keyframe transfers (MakeTransfer), Baseline() and the persister's compaction
// wait for the commit, and should the Publish fail after the pass wrote a tensor, that tensor is
// marked failed (BaselineTensor::deferred_failed: nothing reads it; the next version sends it as
// a keyframe).
// Snapshots queued but not yet published (PublishQueue) add M each wherever they were taken.
class PublisherPersistence;
struct LogReplay;
struct LogRecord;
struct Encoded;
struct LiveEnds;

class PublisherCore {
 public:
  // Creates a core. With options.persist_dir (PersistDir): creates the directory if missing,
  // locks it (FailedPrecondition naming it when another publisher holds it), removes stale
  // temporary files; if it holds a persisted baseline, reloads it (verifying every tensor digest
  // and the version digest) and records that version in the history (without patches), then
  // replays the patch log (persist_dir/patches.log, records above the baseline's version: each
  // applied with the codec, every replayed tensor's digest and every version digest verified)
  // and records those versions with their patches, so subscribers at any of them get deltas of
  // the next version; keeps the lineage. A torn last record (a crash mid-append) is truncated
  // (logged); a corrupt record, another lineage's or one that does not chain stops the replay
  // there: the log is moved aside (patches.corrupt-<unix seconds>.log), load_error names file
  // and offset, and the newest replayed version is compacted into a new baseline. A corrupt
  // baseline, or one of another lineage than persist_dir/lineage, is moved aside
  // (baseline.corrupt-<unix seconds>.safetensors) and the core starts empty with a new lineage:
  // baseline_status() says so (MOVED_ASIDE, the error, the new path). Without a baseline the
  // lineage is new.
  static absl::StatusOr<std::unique_ptr<PublisherCore>> Open(const PublisherOptions& options);

  // With persistence: finishes the queued persistence work first.
  ~PublisherCore();
  PublisherCore(const PublisherCore&) = delete;
  PublisherCore& operator=(const PublisherCore&) = delete;

  // Publishes `version` (> every version numbered so far, <= sync::kMaxVersion) made of
  // `tensors` (non-empty list, sizes matching dtype and shape; each name one whole tensor or
  // parts of it along one dim that do not overlap), after options.cut replaced the matched
  // inputs by their parts (tensor_cut.h; its errors publish nothing). Returns once the snapshot is
  // taken, the patches encoded and the history updated: with persistence, after the lineage file
  // records the number and the version's patch log record is queued for the persister (no baseline
  // or log I/O on this path; see WaitPersisted). On error nothing changes. A degenerate version
  // (publish_guard.h) is FAILED_PRECONDITION unless `allow_degenerate`. `inputs_read` (may be null)
  // is called once the version is committed and the tensors' bytes are no longer read (before
  // persisting): a caller lending its memory may then reuse it (on an error it may once Publish
  // returns).
  absl::StatusOr<PublishSummary> Publish(uint64_t version, std::span<const TensorInput> tensors,
                                         bool allow_degenerate = false,
                                         const std::function<void()>& inputs_read = nullptr);

  // The transfer of the newest version to a subscriber holding `subscriber_version` (0 = none)
  // with version digest `subscriber_version_digest`. FailedPrecondition when nothing is
  // published yet or the subscriber is ahead of the newest version.
  // A transfer with keyframes first brings a relayed baseline's deferred patches forward
  // (waits for a running Publish or adopt; DataLoss when they do not give the version's bytes).
  absl::StatusOr<std::shared_ptr<const Transfer>> MakeTransfer(uint64_t subscriber_version,
                                                               uint64_t subscriber_version_digest,
                                                               const TransferOptions& options = {});

  uint64_t newest_version() const;  // 0 when nothing is published
  // The highest version ever numbered in this lineage (>= newest_version(): with persistence,
  // versions published before a restart whose baseline was not persisted count too).
  uint64_t numbered_version() const;
  // The lineage (non-zero).
  uint64_t lineage() const;
  // The newest patch format Publish may write: PublisherOptions::patch_format, or 2 with
  // patch_format_auto.
  int patch_format() const { return options_.patch_format_auto ? 2 : options_.patch_format; }
  // patch_format_auto: version `version` was acked by every session `micros` after its
  // snapshot (the DataPlane's fully acked refit). Without auto: nothing.
  void NoteRefitLatency(uint64_t version, uint64_t micros);
  // patch_format_auto: the chooser's state; nullopt without auto.
  std::optional<FormatChooser::State> format_choice() const;
  // The persisted baseline: state, path, why it was moved aside at start, the last persist
  // error (persistence of the baseline or of the lineage file).
  v1::BaselineStatus baseline_status() const;
  // With persistence: OK once persist_dir holds a version >= `version` (baseline or patch
  // log); the write's error when it failed; DeadlineExceeded at `deadline`.
  // FailedPrecondition without persistence.
  absl::Status WaitPersisted(uint64_t version, absl::Time deadline) const;
  // Temporary files of interrupted writes removed from persist_dir at Open.
  const std::vector<std::string>& removed_temp_files() const;
  // Without persistence only (a subscriber serving peers whose upstream changed lineage):
  // forgets every version and takes `lineage`. FailedPrecondition with a persist_dir.
  absl::Status Reset(uint64_t lineage);
  uint64_t newest_version_digest() const;  // v1; 0 when nothing is published
  // The newest version and its version digest in `format`, read together ({0, 0} when nothing
  // is published; digest 0 while the version has no digest in `format` yet).
  std::pair<uint64_t, uint64_t> NewestVersionAndDigest(sync::DigestFormat format) const;
  // Wall clock (Unix epoch ns) when the newest version's snapshot was taken; 0 when none.
  uint64_t newest_snapshot_unix_nanos() const;
  // The newest version's tensors, manifest order (waits while a Publish's pass writes baseline
  // buffers in place). A relayed version's changed tensors may still be deferred
  // (BaselineTensor::deferred): their `bytes` are an older version's.
  std::vector<BaselineTensor> Baseline() const;
  // The newest version's tensor specs, manifest order, without waiting for a Publish.
  std::vector<v1::TensorSpec> Manifest() const;
  // The same with every tensor's bytes the newest version's (deferred patches applied first;
  // waits for a running Publish or adopt). DataLoss as MakeTransfer.
  absl::StatusOr<std::vector<BaselineTensor>> BaselineBytes();
  // The degenerate-publish guard of Publish against the current baseline, for callers that want
  // to refuse early (TrainerApi); Publish checks again against the baseline it publishes on.
  absl::Status CheckPublishGuard(const std::vector<GuardTensor>& next, bool allow_degenerate,
                                 absl::string_view where) const;
  sync::HistoryStats HistoryStats() const { return history_.Stats(); }
  // Version digest of a version the history still holds (NotFound otherwise).
  // With `selection`: over the tensors it selects (data.proto Hello.tensors_selected).
  absl::StatusOr<uint64_t> VersionDigestOf(uint64_t version,
                                           sync::DigestFormat format = sync::DigestFormat::kV1,
                                           const sync::TensorSelection* selection = nullptr) const {
    return history_.VersionDigestOf(version, format, selection);
  }

  // Streamed transfers: `on_open` is called when a Publish starts its pass over a version with a
  // base (the CPU one pass, a previous version published), with the LiveVersion of that version;
  // `on_change` after every change of it (a tensor ready, commit, failure). Both run on the
  // publishing thread, without the core's locks. Null functions: no live versions are opened.
  void SetLiveListener(std::function<void(std::shared_ptr<const LiveVersion>)> on_open,
                       std::function<void()> on_change);

  // Relays (a subscriber with serve_peers; docs/ARCHITECTURE.md "Relays"): the transfer its
  // upstream is sending, forwarded to this core's sessions as it arrives, then installed without
  // encoding anything.
  //
  // OpenRelayed: a LiveVersion of the upstream transfer `upstream`, whose objects the caller
  // feeds (LiveVersion::Ready, with the objects exactly as received) and ends (Commit with the
  // upstream's VersionEnd, or Fail). Relayable: a delta (base above 0, target above it) whose
  // tensors are PATCH with one step (sent as they are), UNCHANGED (a zero-byte PATCH object) or
  // KEYFRAME; InvalidArgument naming the first tensor otherwise. When this core's newest version
  // is the upstream transfer's base (same lineage) the version is offered to the data plane at
  // once (`*streaming`): sessions at that base stream it while it arrives (the streamed
  // transfers' path). Otherwise the caller may still feed it and adopt it later.
  absl::StatusOr<std::shared_ptr<LiveVersion>> OpenRelayed(const v1::VersionHeader& upstream,
                                                           bool* streaming);
  // Installs the relayed version `live` (committed: every object ready, its End known in v1 or
  // v2) as the newest version without encoding: the history records its patches and digests
  // (the missing digest format computed from `tensors`, changed tensors only). The baseline
  // keeps a patched tensor's previous bytes with the received patch deferred (applied when
  // something reads the bytes: a keyframe transfer, a Publish, v1 digests; or replaced by
  // `tensors`' bytes once its deferred patches reach 1/8 of its bytes); keyframes take
  // `tensors`' bytes (copied, or TensorInput::owned); unchanged tensors keep theirs. `tensors`:
  // the version's verified bytes (the relay's committed store), any order, exactly the header's
  // tensors (InvalidArgument otherwise). FailedPrecondition when the newest version is not the
  // live version's base or another lineage's, when the core persists its baseline or encodes on
  // a GPU (the caller then publishes the bytes instead); DataLoss when the version digest
  // recomputed from the digests differs from the End's (nothing is installed).
  absl::StatusOr<PublishSummary> AdoptRelayed(const LiveVersion& live,
                                              std::span<const TensorInput> tensors);

  // A session that verifies v1 digests was admitted (DataPlane Hello): from now on v1 digests
  // are computed eagerly, and the newest version's pending ones (lazy_v1_digests) are computed
  // from the baseline now and recorded, so that its transfers can be planned in v1. Older
  // versions whose v1 digests were left pending stay without them (a v1 session at one of them
  // gets keyframes). Cheap once done; waits for a running Publish or adopt.
  void NeedV1Digests();
  // Tensors of the newest version whose v1 digest is pending (lazy_v1_digests).
  size_t pending_v1_digests() const;
  // Whether versions get v1 digests as they are installed (not lazy_v1_digests, or a v1 session
  // was admitted: NeedV1Digests).
  bool v1_digests_wanted() const { return v1_wanted_.load(std::memory_order_acquire); }

 private:
  explicit PublisherCore(const PublisherOptions& options);
  // The replayed versions into the history (with their patches), the baseline and the newest.
  absl::Status RecordReplayed(uint64_t base_version, const LogReplay& replay);
  // Loads `path` (absent: OK, nothing loaded); *lineage = its refit.lineage (0 when absent).
  absl::Status LoadPersisted(const std::string& path, uint64_t* lineage);
  // Open with persist_dir: the baseline and lineage from `dir` (PersistDir::Open removed
  // `removed_temps`), then the persistence started.
  static absl::StatusOr<std::unique_ptr<PublisherCore>> OpenPersisted(
      const PublisherOptions& options, std::unique_ptr<PersistDir> dir,
      std::vector<std::string> removed_temps);
  // The newest version's pending v1 digests computed from the baseline bytes and recorded
  // (history, baseline, newest digest); nothing when none is pending.
  void CompletePendingV1Locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_);
  // The baseline tensors AdoptRelayed left with deferred patches brought to the newest version's
  // bytes (in place when the core holds the buffer alone, else into a copy; the digest v2 of the
  // result must be the version's). DataLoss naming the tensors that did not (marked
  // deferred_failed: the next adopted version's bytes replace them).
  absl::Status MaterializeBaselineLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // MakeTransfer under mu_: the plan into `t`, and unless `needs_bytes` is set true (the plan has
  // keyframes and a tensor is deferred: nothing else done) the baseline, the counts and the
  // newest version's figures it needs. needs_bytes null: the baseline is taken as it is.
  absl::Status PlanTransferLocked(uint64_t subscriber_version, uint64_t subscriber_version_digest,
                                  const TransferOptions& options, Transfer* t,
                                  std::vector<BaselineTensor>* baseline,
                                  std::vector<VersionCounts>* counts, bool* needs_bytes) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Publish: the lineage file records `version` before it becomes visible.
  void RecordNumbered(uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_);
  // Publish: the live version of `version` on top of `prev` (null without a listener, a base or
  // the CPU one pass), announced to the listener.
  std::shared_ptr<LiveVersion> OpenLive(uint64_t version, uint64_t prev_version,
                                        const std::vector<BaselineTensor>& prev,
                                        const std::vector<v1::TensorSpec>& specs,
                                        const std::vector<size_t>& order, uint64_t snapshot_nanos);
  // Publish's steps. The checks of a version number and its inputs before any encoding (specs
  // and manifest order out).
  absl::Status CheckPublishable(uint64_t version, uint64_t prev_version,
                                std::span<const TensorInput> given,
                                const std::vector<BaselineTensor>& prev, bool allow_degenerate,
                                const std::string& where, std::vector<v1::TensorSpec>* specs,
                                std::vector<size_t>* order) const;
  // The newest version's fields once `version` is recorded (digest and figures from `sum`).
  void SetNewestLocked(uint64_t version, const PublishSummary& sum)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publish's commit, in two steps under mu_. First the version's digests go into the history
  // (its version digest into `sum`) and, with a live version, its Ends are made; the newest
  // version and the baseline stay the previous ones, so nothing can ask for the new version's
  // bytes yet. Then, once the End is out, InstallVersion brings the baseline buffers up to date
  // (update_baseline: in place or copied, filling `next`'s buffers and `sum`'s update figures)
  // and installs them with the newest version, together.
  absl::Status RecordInHistory(uint64_t version, uint64_t prev_version,
                               std::vector<sync::TensorUpdate> updates, bool live,
                               const std::string& where, PublishSummary* sum, uint64_t* lineage,
                               LiveEnds* live_ends) ABSL_LOCKS_EXCLUDED(mu_);
  // With StreamPass::defer_v1, after the v2 End: `digests` (every tensor's v1 digest, name
  // order) completes the history's record, the version digest goes into `sum`, and the live
  // version's v1 sessions get their End (or `live` fails for them).
  absl::Status RecordV1(uint64_t version, uint64_t prev_version,
                        const std::vector<uint64_t>& digests, LiveVersion* live,
                        PublishSummary* sum) ABSL_LOCKS_EXCLUDED(mu_);
  // Publish's base: the baseline with a relay's deferred patches applied and the pending v1
  // digests completed when wanted, less the tensors whose bytes are lost (sent as keyframes).
  std::vector<BaselineTensor> PublishBase(uint64_t version, uint64_t* prev_version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Publish, once the version is in the history: the live version's Ends go out (SettleLive)
  // and the v1 digests the version lacks are computed (v1 wanted) or left pending.
  void EndLive(uint64_t version, uint64_t prev_version, LiveVersion* live, LiveEnds ends,
               const std::string& where, Encoded* enc, PublishSummary* sum)
      ABSL_LOCKS_EXCLUDED(mu_);
  // With the v1 digests deferred: computes them (FillDeferredV1) and records them (RecordV1);
  // a failure is logged, the version installed regardless.
  void CompleteDeferredV1(uint64_t version, uint64_t prev_version, LiveVersion* live, Encoded* enc,
                          PublishSummary* sum) ABSL_LOCKS_EXCLUDED(mu_);
  // Publish, before the CPU one pass: which of `prev`'s buffers the pass may write in place (the
  // core alone holds them: baseline_ and `prev`), with baseline_updating_ set when any. Empty
  // when the pass writes none.
  std::vector<bool> BeginPassUpdate(const std::vector<BaselineTensor>& prev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // A Publish that fails after its pass began: the buffers the pass wrote get their previous
  // bytes back (EncodedChanges::Undo; one that cannot is marked failed), and baseline_updating_
  // is cleared.
  void AbortPassUpdate(const Encoded& enc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool BaselineReadable() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !baseline_updating_; }
  void InstallVersion(uint64_t version, absl::FunctionRef<void()> update_baseline,
                      std::vector<BaselineTensor>& next, GpuBaselineMap& gpu, VersionCounts counts,
                      const PublishSummary& sum) ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);

  const PublisherOptions options_;
  // v1 digests are computed as versions are installed (always, unless lazy_v1_digests and no v1
  // session was admitted yet: NeedV1Digests).
  std::atomic<bool> v1_wanted_;
  sync::PatchHistory history_;
  absl::Mutex publish_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // serialises Publish
  mutable absl::Mutex mu_;
  uint64_t newest_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t newest_digest_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t snapshot_unix_nanos_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t encode_micros_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pass_micros_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t baseline_update_micros_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<BaselineTensor> baseline_ ABSL_GUARDED_BY(mu_);  // manifest order
  // A Publish's pass is writing baseline buffers in place (update_baseline_in_pass): nothing may
  // read baseline bytes until the commit (or the failure) clears it.
  bool baseline_updating_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t lineage_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t numbered_ ABSL_GUARDED_BY(mu_) = 0;
  // Encoder changed-element counts per retained version and tensor (for VersionEnd).
  std::vector<VersionCounts> counts_ ABSL_GUARDED_BY(mu_);
  // GPU encoding: the newest version's tensors on their devices (or pinned), by place
  // (TensorPlace); a subset of baseline_ (missing entries are uploaded from baseline_ when
  // needed). Only Publish uses it.
  GpuBaselineMap gpu_baseline_ ABSL_GUARDED_BY(publish_mu_);
  // Wire bytes of the newest version from its previous one (a live version's size estimate).
  uint64_t newest_wire_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The streamed transfers' listener (its own lock; ordered after mu_ where both are held).
  LiveListener live_listener_;
  // With persist_dir: the lineage file, the background persister (patch log + compaction) and
  // the baseline status. Destroyed first (~PublisherCore).
  std::unique_ptr<PublisherPersistence> persistence_;
  // patch_format_auto only (thread-safe itself).
  std::unique_ptr<FormatChooser> chooser_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_PUBLISHER_CORE_H_

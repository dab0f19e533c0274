// TransferSink: where an Upstream session hands the transfers it receives. The subscriber's
// SubscriberCore behind CoreSink (one upstream, whole versions), or one shard's port of a
// ShardJoin (daemon/subscriber/shard_join.h), which joins the parts of a sharded version that
// K sessions receive into one transfer of the core.
//
// The calls mirror SubscriberCore's (see there for their contracts) with three additions:
//   - OnFrame may rewrite the frame (a shard port renumbers its tensor_index);
//   - OnHeader may wait (a shard port holds a header until every shard offered the version);
//     Interrupt, from any thread, makes such a wait return CANCELLED (the session is ending);
//   - CheckWelcome refuses a publisher of the wrong kind (a shard of a sharded version where a
//     whole one is expected, or the wrong shard).
// Applied version, digest, lineage and tensor digests are those of what this session serves:
// a shard port reports its shard's tensors only (the Hello to that shard's publisher).
#ifndef REFIT_DAEMON_SUBSCRIBER_TRANSFER_SINK_H_
#define REFIT_DAEMON_SUBSCRIBER_TRANSFER_SINK_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "daemon/subscriber/subscriber_core.h"
#include "daemon/sync/digest_format.h"
#include "refit/v1/data.pb.h"

namespace refit::subscriber {

class TransferSink {
 public:
  virtual ~TransferSink() = default;

  virtual absl::Status CheckWelcome(const v1::Welcome& welcome) = 0;
  virtual void SetMaxFrameBytes(uint32_t frame_bytes) = 0;
  virtual void SetDigestFormat(sync::DigestFormat format) = 0;

  virtual absl::Status OnHeader(const v1::VersionHeader& header) = 0;
  virtual absl::Status OnFrame(v1::DataFrame& frame) = 0;
  virtual v1::Ack OnEnd(const v1::VersionEnd& end) = 0;
  virtual void Abort() = 0;
  virtual void Interrupt() = 0;

  virtual uint64_t applied_version() const = 0;
  virtual uint64_t applied_digest() const = 0;
  virtual uint64_t applied_lineage() const = 0;
  virtual std::vector<v1::TensorDigest> applied_tensor_digests() const = 0;
  // The store generation (AppliedEvent::layout_changed).
  virtual uint64_t generation() const = 0;

  // SubscriberCore::ExpectRepair / pending_repair (scrub repairs).
  virtual bool ExpectRepair(uint64_t version) = 0;
  virtual uint64_t pending_repair() const = 0;
};

// The core as the sink of one unsharded upstream (tests derive from it to intercept a call).
class CoreSink : public TransferSink {
 public:
  explicit CoreSink(SubscriberCore* core) : core_(core) {}

  // A shard of a sharded version is not a whole version: FAILED_PRECONDITION.
  absl::Status CheckWelcome(const v1::Welcome& welcome) override;
  void SetMaxFrameBytes(uint32_t frame_bytes) override { core_->SetMaxFrameBytes(frame_bytes); }
  void SetDigestFormat(sync::DigestFormat format) override { core_->SetDigestFormat(format); }
  absl::Status OnHeader(const v1::VersionHeader& header) override {
    return core_->OnHeader(header);
  }
  absl::Status OnFrame(v1::DataFrame& frame) override { return core_->OnFrame(frame); }
  v1::Ack OnEnd(const v1::VersionEnd& end) override { return core_->OnEnd(end); }
  void Abort() override { core_->Abort(); }
  void Interrupt() override {}  // nothing of the core waits on a session
  uint64_t applied_version() const override { return core_->applied_version(); }
  uint64_t applied_digest() const override { return core_->applied_digest(); }
  uint64_t applied_lineage() const override { return core_->applied_lineage(); }
  std::vector<v1::TensorDigest> applied_tensor_digests() const override {
    return core_->records().tensor_digests();
  }
  uint64_t generation() const override { return core_->generations().generation(); }
  bool ExpectRepair(uint64_t version) override { return core_->ExpectRepair(version); }
  uint64_t pending_repair() const override { return core_->pending_repair(); }

 private:
  SubscriberCore* const core_;
};

}  // namespace refit::subscriber

#endif  // REFIT_DAEMON_SUBSCRIBER_TRANSFER_SINK_H_

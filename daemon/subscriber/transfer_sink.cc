#include "daemon/subscriber/transfer_sink.h"

#include "absl/strings/str_cat.h"

namespace refit::subscriber {

absl::Status CoreSink::CheckWelcome(const v1::Welcome& welcome) {
  if (!welcome.has_shard()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the upstream serves shard ", welcome.shard().index(), " of the ", welcome.shard().count(),
      " shards of set \"", welcome.shard().set(),
      "\", not whole versions: list the set's publishers in subscriber.upstream.shards"));
}

}  // namespace refit::subscriber

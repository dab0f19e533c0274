#include "client/refitctl_format.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/hex.h"
#include "daemon/common/printable.h"
#include "google/protobuf/util/json_util.h"

namespace refit::client {
namespace {

std::string RoleName(v1::Role role) {
  switch (role) {
    case v1::ROLE_PUBLISHER: return "publisher";
    case v1::ROLE_SUBSCRIBER: return "subscriber";
    default: return "unknown";
  }
}

std::string StateName(v1::SessionState state) {
  switch (state) {
    case v1::SESSION_STATE_CONNECTING: return "connecting";
    case v1::SESSION_STATE_IDLE: return "idle";
    case v1::SESSION_STATE_TRANSFERRING: return "transferring";
    case v1::SESSION_STATE_BACKOFF: return "backoff";
    default: return "-";
  }
}

std::string FormatUptime(uint64_t ms) {
  const uint64_t s = ms / 1000;
  if (s < 60) return absl::StrFormat("%.1fs", ms / 1000.0);
  if (s < 3600) return absl::StrFormat("%um%02us", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%uh%02um%02us", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%ud%02uh%02um", s / 86400, (s / 3600) % 24, (s / 60) % 60);
}

std::string FormatUnixNanos(uint64_t nanos) {
  if (nanos == 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixNanos(static_cast<int64_t>(nanos)),
                          absl::UTCTimeZone());
}

std::string FormatRefit(const v1::RefitStats& r) {
  if (r.version() == 0) return "none";
  std::string s = absl::StrCat("version ", r.version());
  if (r.base_version() != 0) {
    absl::StrAppend(&s, " from ", r.base_version());
  } else {
    absl::StrAppend(&s, " (keyframe)");
  }
  absl::StrAppend(&s, ", change ", FormatPercent(r.change_rate()), ", wire ",
                  FormatBytes(r.wire_bytes()), " of ", FormatBytes(r.dense_bytes()), " dense");
  if (r.dense_bytes() > 0) {
    absl::StrAppend(&s, absl::StrFormat(" (%.2f%%)", 100.0 * r.wire_bytes() / r.dense_bytes()));
  }
  absl::StrAppend(&s, ", ", r.keyframe_tensors(), " keyframe tensors, latency ",
                  FormatMicros(r.latency_micros()));
  if (r.cpu_micros() != 0) absl::StrAppend(&s, ", cpu ", FormatMicros(r.cpu_micros()));
  absl::StrAppend(&s, ", digests ", r.digests_verified() ? "verified" : "not verified",
                  ", finished ", FormatUnixNanos(r.finished_unix_nanos()));
  return s;
}

// Columns padded to their widest cell, two spaces apart, indented by two.
std::string RenderTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line = "  ";
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::vector<std::string> SessionHeader() {
  return {"NAME",     "STATE",      "ACKED",   "LAG",    "STREAMS", "SENT",
          "RECEIVED", "LAST REFIT", "LATENCY", "CHANGE", "ADDRESS"};
}

std::vector<std::string> SessionRow(const v1::SessionStatus& s) {
  std::string name = s.name().empty() ? "-" : s.name();
  if (!s.identity().empty() && s.identity() != s.name())
    absl::StrAppend(&name, " (", s.identity(), ")");
  const v1::RefitStats& r = s.last_refit();
  return {name,
          StateName(s.state()),
          absl::StrCat(s.acked_version()),
          absl::StrCat(s.lag_versions()),
          absl::StrCat(s.streams()),
          FormatBytes(s.bytes_sent()),
          FormatBytes(s.bytes_received()),
          r.version() == 0 ? "-" : absl::StrCat(r.version()),
          r.version() == 0 ? "-" : FormatMicros(r.latency_micros()),
          r.version() == 0 ? "-" : FormatPercent(r.change_rate()),
          s.address().empty() ? "-" : s.address()};
}

std::string SessionErrors(const std::vector<const v1::SessionStatus*>& sessions) {
  std::string out;
  for (const v1::SessionStatus* s : sessions) {
    if (!s->last_error().empty()) {
      absl::StrAppend(&out, "  ", s->name().empty() ? "-" : s->name(),
                      ": last error: ", s->last_error(), "\n");
    }
  }
  return out;
}

// "4 clients (rank0, rank1, rank2, rank3), 18 sliced tensors; version 7: waits for rank3
// (3 of 4 published)": the TrainerApi's clients and the round they are assembling.
std::string FormatTrainers(const v1::TrainerApiStatus& t) {
  std::vector<std::string> names;
  for (const v1::TrainerApiStatus::Client& c : t.clients()) names.push_back(c.name());
  std::string out =
      absl::StrCat(t.clients_size(), t.clients_size() == 1 ? " client (" : " clients (",
                   absl::StrJoin(names, ", "), ")");
  if (t.sliced_tensors() > 0) absl::StrAppend(&out, ", ", t.sliced_tensors(), " sliced tensors");
  if (t.round_version() == 0) return absl::StrCat(out, "; no version being assembled");
  return absl::StrCat(out, "; version ", t.round_version(), ": waits for ",
                      absl::StrJoin(t.waiting_for(), ", "), " (", t.published_size(), " of ",
                      t.published_size() + t.waiting_for_size(), " published)");
}

// A shard publisher's parts of its sliced tensors: "\"w\" rows [40, 100) of 250, \"b\" whole,
// \"e\" none" (the first eight, then a count); empty on any other publisher.
std::string FormatShardParts(const v1::TrainerApiStatus& t) {
  std::vector<std::string> parts;
  constexpr int kListed = 8;
  for (const v1::TrainerApiStatus::Sliced& s : t.sliced()) {
    if (!s.shard_part()) continue;
    if (static_cast<int>(parts.size()) == kListed) {
      parts.push_back(absl::StrCat("and ", t.sliced_size() - kListed, " more"));
      break;
    }
    const uint64_t whole_rows = s.whole_shape_size() > 0 ? s.whole_shape(0) : 0;
    if (s.rows() == 0) {
      parts.push_back(absl::StrCat(Quoted(s.name()), " none"));
    } else if (s.first_row() == 0 && s.rows() == whole_rows) {
      parts.push_back(absl::StrCat(Quoted(s.name()), " whole"));
    } else {
      parts.push_back(absl::StrCat(Quoted(s.name()), " rows [", s.first_row(), ", ",
                                   s.first_row() + s.rows(), ") of ", whole_rows));
    }
  }
  return absl::StrJoin(parts, ", ");
}

// "persisted (version 7) at /var/lib/refitd/baseline.safetensors", with the errors in full.
std::string FormatBaseline(const v1::BaselineStatus& b) {
  std::string state;
  switch (b.state()) {
    case v1::BASELINE_STATE_DISABLED: return "not persisted (no persist_dir)";
    case v1::BASELINE_STATE_EMPTY: state = "none persisted yet"; break;
    case v1::BASELINE_STATE_LOADED: state = "reloaded at start"; break;
    case v1::BASELINE_STATE_PERSISTED: state = "persisted"; break;
    case v1::BASELINE_STATE_PERSIST_FAILED: state = "PERSIST FAILED"; break;
    case v1::BASELINE_STATE_MOVED_ASIDE: state = "REFUSED AT START, moved aside"; break;
    default: state = "unknown"; break;
  }
  std::string out = state;
  if (b.persisted_version() != 0) {
    absl::StrAppend(&out, " (files hold version ", b.persisted_version(), ": baseline version ",
                    b.baseline_version(), " + ", b.log_versions(), " in the patch log, ",
                    FormatBytes(b.log_bytes()), ")");
  }
  absl::StrAppend(&out, " at ", b.path());
  if (!b.moved_to().empty()) {
    absl::StrAppend(&out, "\n            refused file now at ", b.moved_to(), ": ", b.load_error());
  } else if (!b.load_error().empty()) {
    absl::StrAppend(&out, "\n            patch log refused at start: ", b.load_error());
  }
  if (!b.last_persist_error().empty()) {
    absl::StrAppend(&out, "\n            last persist error (",
                    FormatUnixNanos(b.last_persist_error_unix_nanos()),
                    "): ", b.last_persist_error());
  }
  return out;
}

// Status.tls: one line per TLS block, plus its refused reload if any.
std::string FormatTls(const v1::StatusResponse& st) {
  if (st.tls_size() == 0) return "";
  std::string out = "\ntls:\n";
  for (const v1::TlsMaterialStatus& t : st.tls()) {
    absl::StrAppend(
        &out, "  ", t.field(), ": ", t.subject(), ", not after ",
        absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixSeconds(t.not_after_unix_seconds()),
                         absl::UTCTimeZone()),
        ", sha256 ", t.sha256_fingerprint(), ", reloads ", t.reloads(), "\n");
    if (!t.last_reload_error().empty()) {
      absl::StrAppend(&out, "    last reload refused (old material kept): ", t.last_reload_error(),
                      "\n");
    }
  }
  return out;
}

// A relay (serve_peers): how its upstream's transfers reach its peers.
std::string FormatRelay(const v1::RelayStatus& r) {
  std::string out = absl::StrCat(
      r.cut_through() ? "cut-through" : "encodes every version again", ": ", r.streamed(), " of ",
      r.transfers(), " transfers streamed to peers while arriving (", r.peer_streamed_transfers(),
      " taken), ", FormatBytes(r.object_bytes()), "; installed ", r.adopted_versions(),
      " from the patches received, ", r.reencoded_versions(), " by encoding");
  if (r.failed() > 0 || r.not_relayable() > 0) {
    absl::StrAppend(&out, "; ", r.failed(), " failed, ", r.not_relayable(), " not relayable");
  }
  if (!r.last_error().empty()) absl::StrAppend(&out, " (last: ", r.last_error(), ")");
  return out;
}

// Sharded versions: a publisher's shard identity, or a subscriber's join of its shards.
std::string FormatShardsLine(const v1::StatusResponse& st) {
  const v1::ShardsStatus& s = st.shards();
  if (st.role() == v1::ROLE_PUBLISHER) {
    return absl::StrCat("shard ", s.index(), " of ", s.count(), " of set ", s.set());
  }
  std::string out = absl::StrCat("set ", s.set(), ", ", s.count(), " shards: ", s.joined_versions(),
                                 " versions joined, ", s.failed_transfers(), " failed, ",
                                 s.superseded(), " superseded");
  if (s.waiting_version() != 0) {
    absl::StrAppend(&out, "; version ", s.waiting_version(), " waits for shard",
                    s.waiting_for_size() == 1 ? " " : "s ", absl::StrJoin(s.waiting_for(), ", "));
  }
  return out;
}

// A subscriber's shards, one row each.
std::string FormatShardsTable(const v1::ShardsStatus& s) {
  std::vector<std::vector<std::string>> rows = {
      {"shard", "state", "offered", "tensors", "bytes", "received", "address"}};
  std::string errors;
  for (const v1::ShardStatus& p : s.shards()) {
    rows.push_back(
        {absl::StrCat(p.index()), StateName(p.session().state()),
         p.offered_version() == 0
             ? std::string("-")
             : absl::StrCat(p.offered_version(), p.joined() ? " (joined)" : " (waiting)"),
         absl::StrCat(p.tensors()), FormatBytes(p.bytes()), FormatBytes(p.wire_bytes()),
         p.session().address().empty() ? "-" : p.session().address()});
    const std::string& e = p.last_error().empty() ? p.session().last_error() : p.last_error();
    if (!e.empty()) absl::StrAppend(&errors, "  shard ", p.index(), ": last error: ", e, "\n");
  }
  return RenderTable(rows) + errors;
}

// Status.patch_format: "v2" or "v1 (auto: trial, v1 480 ms over 2, v2 1150 ms over 1; next v2)".
std::string FormatPatchFormat(const v1::PatchFormatStatus& p) {
  std::string out = absl::StrCat("v", p.last());
  if (!p.auto_choice()) return out;
  const auto median = [](uint64_t us, uint32_t n) {
    return n == 0 ? std::string("none") : absl::StrCat(us / 1000, " ms over ", n);
  };
  absl::StrAppend(&out, " (auto: ",
                  p.chosen() == 0 ? std::string("trial") : absl::StrCat("chose v", p.chosen()),
                  ", v1 ", median(p.median_refit_micros_v1(), p.samples_v1()), ", v2 ",
                  median(p.median_refit_micros_v2(), p.samples_v2()), "; next v", p.next(), ")");
  return out;
}

// "12 (digest 0x…, v2; v1 0x…)": the version digest, the tensor digest format it is in (when the
// daemon says), and a publisher's v1 digest for comparing with subscribers that asked for v1.
std::string FormatStatusVersion(const v1::StatusResponse& st) {
  std::string out = absl::StrCat(st.version(), " (digest ", FormatDigest(st.version_digest()));
  if (st.digest_format() != 0) absl::StrAppend(&out, ", v", st.digest_format());
  if (st.version_digest_v1() != 0) {
    absl::StrAppend(&out, "; v1 ", FormatDigest(st.version_digest_v1()));
  }
  return absl::StrCat(out, ")");
}

// The status table's first part: one "key: value" line each.
std::string FormatStatusLines(const v1::StatusResponse& st) {
  std::string out;
  auto line = [&out](const std::string& key, const std::string& value) {
    absl::StrAppend(&out, absl::StrFormat("%-12s%s\n", key + ":", value));
  };
  line("role", RoleName(st.role()));
  line("name", st.name().empty() ? "-" : st.name());
  line("build", st.build_version().empty() ? "-" : st.build_version());
  line("uptime", FormatUptime(st.uptime_ms()));
  line("version", st.version() == 0 ? std::string("none") : FormatStatusVersion(st));
  line("model", absl::StrCat(st.tensors(), " tensors, ", FormatBytes(st.model_bytes())));
  line("traffic", absl::StrCat("sent ", FormatBytes(st.bytes_sent()), ", received ",
                               FormatBytes(st.bytes_received())));
  line("metrics", st.metrics_address().empty()
                      ? std::string("off (config metrics.listen is empty)")
                      : absl::StrCat("http://", st.metrics_address(), "/metrics"));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_history()) {
    const v1::HistoryStatus& h = st.history();
    line("history", h.versions() == 0
                        ? absl::StrCat("empty, budget ", FormatBytes(h.budget_bytes()))
                        : absl::StrCat("versions ", h.oldest_version(), "..", h.newest_version(),
                                       " (", h.versions(), " held), ", FormatBytes(h.bytes()),
                                       " of ", FormatBytes(h.budget_bytes()), " budget"));
  }
  line("last refit", FormatRefit(st.last_refit()));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_patch_format()) {
    line("patch fmt", FormatPatchFormat(st.patch_format()));
  }
  if (st.lineage() != 0) line("lineage", Hex64(st.lineage()));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_baseline())
    line("baseline", FormatBaseline(st.baseline()));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_publish_queue()) {
    const v1::PublishQueueStatus& q = st.publish_queue();
    line("publish q",
         absl::StrCat(q.pending(), " pending of at most ", q.max_pending(), ", ", q.refused_full(),
                      " refused (full), ", q.dropped_expired(), " dropped (caller gone)"));
  }

  if (st.role() == v1::ROLE_PUBLISHER && st.trainer_api().clients_size() > 0) {
    line("trainers", FormatTrainers(st.trainer_api()));
    if (std::string parts = FormatShardParts(st.trainer_api()); !parts.empty()) {
      line("parts", parts);
    }
  }

  if (st.role() == v1::ROLE_SUBSCRIBER && st.has_relay()) line("relay", FormatRelay(st.relay()));
  if (st.has_shards()) line("shards", FormatShardsLine(st));
  return out;
}

// The status table's session sections: the upstream (subscribers, relays) and the sessions.
std::string FormatSessionSections(const v1::StatusResponse& st) {
  std::string out;
  if (st.role() == v1::ROLE_SUBSCRIBER || st.has_upstream()) {
    out += "\nupstream:\n";
    if (st.has_upstream()) {
      out += RenderTable({SessionHeader(), SessionRow(st.upstream())});
      out += SessionErrors({&st.upstream()});
    } else {
      out += "  none\n";
    }
  }

  absl::StrAppend(&out, "\n",
                  st.role() == v1::ROLE_SUBSCRIBER ? "peer sessions" : "subscriber sessions", " (",
                  st.sessions_size(), "):\n");
  if (st.sessions_size() > 0) {
    std::vector<std::vector<std::string>> rows = {SessionHeader()};
    std::vector<const v1::SessionStatus*> all;
    for (const v1::SessionStatus& s : st.sessions()) {
      rows.push_back(SessionRow(s));
      all.push_back(&s);
    }
    out += RenderTable(rows);
    out += SessionErrors(all);
  }
  return out;
}

// The status table's leases section (subscribers, or wherever there are leases).
std::string FormatLeases(const v1::StatusResponse& st) {
  std::string out;
  if (st.role() == v1::ROLE_SUBSCRIBER || st.leases_size() > 0) {
    absl::StrAppend(&out, "\nleases (", st.leases_size(), "):\n");
    if (st.leases_size() > 0) {
      std::vector<std::vector<std::string>> rows = {{"ID", "CONSUMER", "VERSION", "REMAINING"}};
      for (const v1::LeaseStatus& l : st.leases()) {
        rows.push_back({Hex64(l.lease_id()), l.consumer().empty() ? "-" : l.consumer(),
                        absl::StrCat(l.version()),
                        absl::StrFormat("%.1f s", l.remaining_ms() / 1000.0)});
      }
      out += RenderTable(rows);
    }
  }
  return out;
}

// The BLOCKED ON LEASES section, when a version waits for a free slot.
std::string FormatLeaseBlock(const v1::StatusResponse& st) {
  if (!st.has_blocked_on_leases()) return "";
  std::string out;
  const v1::LeaseBlockStatus& b = st.blocked_on_leases();
  const absl::Duration waited =
      absl::Now() - absl::FromUnixNanos(static_cast<int64_t>(b.since_unix_nanos()));
  absl::StrAppend(&out, "\nBLOCKED ON LEASES: version ", b.version(),
                  " waits for a free slot (versions waiting for ",
                  absl::StrFormat("%.1f s", absl::ToDoubleSeconds(waited)), "); held by:\n");
  for (const std::string& h : b.holders()) absl::StrAppend(&out, "  ", h, "\n");
  return out;
}

}  // namespace

std::string FormatDigest(uint64_t digest) { return absl::StrCat("0x", Hex64(digest)); }

std::string FormatPercent(double rate) { return absl::StrFormat("%.3f%%", 100.0 * rate); }

std::string FormatStatusTable(const v1::StatusResponse& st) {
  std::string out = FormatStatusLines(st);
  if (st.role() == v1::ROLE_SUBSCRIBER && st.shards().shards_size() > 0) {
    out += "\nshards:\n" + FormatShardsTable(st.shards());
  }
  out += FormatSessionSections(st);
  out += FormatLeases(st);
  out += FormatTls(st);
  out += FormatLeaseBlock(st);
  return out;
}

absl::StatusOr<std::string> FormatStatusJson(const v1::StatusResponse& status) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.add_whitespace = true;
  std::string json;
  auto s = google::protobuf::util::MessageToJsonString(status, &json, options);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot render StatusResponse as JSON: ", s.ToString()));
  }
  if (json.empty() || json.back() != '\n') json += "\n";
  return json;
}

}  // namespace refit::client

// The persisted baseline's file (baseline_file.h): a safetensors file whose metadata records the
// version, its digest, each tensor's v1 digest, the snapshot time and the lineage.
#include "daemon/serving/baseline_file.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/codec/digest_v2.h"
#include "daemon/codec/hash.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/model/safetensors.h"
#include "daemon/serving/publisher_core_internal.h"
#include "daemon/sync/tensor_part.h"
#include "daemon/sync/version_digest.h"
#include "daemon/sync/versions.h"

namespace refit::publisher {
namespace {

constexpr char kMetaFormat[] = "refit.format";
constexpr char kMetaVersion[] = "refit.version";
constexpr char kMetaVersionDigest[] = "refit.version_digest";
constexpr char kMetaDigests[] = "refit.digests";
constexpr char kMetaSnapshot[] = "refit.snapshot_unix_nanos";
constexpr char kMetaLineage[] = "refit.lineage";
constexpr char kFormatValue[] = "1";
// Per entry that is a part (TensorSpec.part): `refit.part.<entry name>` =
// "<first_row>:<whole dims joined by ','>:<dim>:<tensor name>", e.g. "64:256,512:1:o", or, for a
// part along dim 0 whose entry is named after its tensor (one part of that name; all that files
// written before parts had a dim hold), "<first_row>:<whole dims>", e.g. "40:250,8". The entry
// holds the part's own elements (row-major in the part's shape).
constexpr char kMetaPartPrefix[] = "refit.part.";

// A row part whose entry is named after its tensor keeps the two-field format (what shard
// publishers wrote before parts had a dim); every other part gets all four fields.
std::string EncodePart(const v1::TensorSpec& spec, const std::string& entry) {
  const v1::TensorPart& part = spec.part();
  std::string head = absl::StrCat(part.first_row(), ":", absl::StrJoin(part.whole_shape(), ","));
  if (part.dim() == 0 && entry == spec.name()) return head;
  return absl::StrCat(head, ":", part.dim(), ":", spec.name());
}

// The part of entry `entry` (EncodePart, or the two-field format of older files) into `spec`,
// whose name it sets.
bool ParsePart(const std::string& s, const std::string& entry, v1::TensorSpec* spec) {
  std::vector<std::string> fields = absl::StrSplit(s, absl::MaxSplits(':', 3));
  uint64_t first_row = 0;
  uint32_t dim = 0;
  if ((fields.size() != 2 && fields.size() != 4) || !absl::SimpleAtoi(fields[0], &first_row) ||
      fields[1].empty()) {
    return false;
  }
  if (fields.size() == 4 && (!absl::SimpleAtoi(fields[2], &dim) || fields[3].empty())) return false;
  spec->set_name(fields.size() == 4 ? fields[3] : entry);
  v1::TensorPart* part = spec->mutable_part();
  part->set_first_row(first_row);
  part->set_dim(dim);
  for (const absl::string_view d : absl::StrSplit(fields[1], ',')) {
    uint64_t v = 0;
    if (!absl::SimpleAtoi(d, &v)) return false;
    part->add_whole_shape(v);
  }
  return true;
}

// The safetensors entry name of baseline tensor `k` (manifest order): the tensor's name, or for
// one of several parts of a name "<name>@<dim>.<first_row>" (the part metadata names the tensor).
std::string EntryName(const std::vector<BaselineTensor>& tensors, size_t k) {
  const v1::TensorSpec& s = tensors[k].spec;
  const bool shared = (k > 0 && tensors[k - 1].spec.name() == s.name()) ||
                      (k + 1 < tensors.size() && tensors[k + 1].spec.name() == s.name());
  if (!shared) return s.name();
  return absl::StrCat(s.name(), "@", s.part().dim(), ".", s.part().first_row());
}

bool ParseHex64(const std::string& s, uint64_t* out) {
  if (s.size() != 16) return false;
  return absl::SimpleHexAtoi(s, out);
}

// A persisted baseline's metadata (ReadBaselineFile).
struct PersistedMeta {
  uint64_t version = 0;
  uint64_t version_digest = 0;
  uint64_t snapshot_unix_nanos = 0;
  uint64_t lineage = 0;                      // 0: a file from before lineages
  std::vector<std::string> digests;          // per tensor, file order, hex
  std::map<std::string, std::string> parts;  // entry name -> kMetaPartPrefix value
};

absl::StatusOr<PersistedMeta> ParsePersistedMeta(const model::SafetensorsFile& file,
                                                 const std::string& where) {
  const auto& meta = file.metadata();
  auto get = [&](const char* key) -> absl::StatusOr<std::string> {
    auto it = meta.find(key);
    if (it == meta.end()) {
      return absl::DataLossError(absl::StrCat(where, ": metadata key ", Quoted(key), " missing"));
    }
    return it->second;
  };
  REFIT_ASSIGN_OR_RETURN(std::string format, get(kMetaFormat));
  if (format != kFormatValue) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": unsupported format ", Quoted(format), " (expected ", kFormatValue, ")"));
  }
  REFIT_ASSIGN_OR_RETURN(std::string version_s, get(kMetaVersion));
  REFIT_ASSIGN_OR_RETURN(std::string vdigest_s, get(kMetaVersionDigest));
  REFIT_ASSIGN_OR_RETURN(std::string digests_s, get(kMetaDigests));
  PersistedMeta m;
  if (!absl::SimpleAtoi(version_s, &m.version) || m.version == 0) {
    return absl::DataLossError(absl::StrCat(where, ": bad ", kMetaVersion, " ", Quoted(version_s)));
  }
  if (!ParseHex64(vdigest_s, &m.version_digest)) {
    return absl::DataLossError(
        absl::StrCat(where, ": bad ", kMetaVersionDigest, " ", Quoted(vdigest_s)));
  }
  if (auto it = meta.find(kMetaSnapshot); it != meta.end()) {
    if (!absl::SimpleAtoi(it->second, &m.snapshot_unix_nanos)) m.snapshot_unix_nanos = 0;
  }
  if (m.version > sync::kMaxVersion) {
    return absl::DataLossError(absl::StrCat(where, ": ", kMetaVersion, " ", m.version,
                                            " is above the largest version ", sync::kMaxVersion));
  }
  if (auto it = meta.find(kMetaLineage); it != meta.end()) {
    if (!ParseHex64(it->second, &m.lineage) || m.lineage == 0) {
      return absl::DataLossError(
          absl::StrCat(where, ": bad ", kMetaLineage, " ", Quoted(it->second)));
    }
  }
  if (!digests_s.empty()) m.digests = absl::StrSplit(digests_s, ',');
  if (m.digests.size() != file.tensors().size()) {
    return absl::DataLossError(absl::StrCat(where, ": ", kMetaDigests, " has ", m.digests.size(),
                                            " entries for ", file.tensors().size(), " tensors"));
  }
  if (file.tensors().empty()) return absl::DataLossError(absl::StrCat(where, ": no tensors"));
  for (auto it = meta.lower_bound(kMetaPartPrefix);
       it != meta.end() && it->first.starts_with(kMetaPartPrefix); ++it) {
    const std::string name = it->first.substr(sizeof(kMetaPartPrefix) - 1);
    const bool held = std::any_of(file.tensors().begin(), file.tensors().end(),
                                  [&](const model::SafetensorsEntry& e) { return e.name == name; });
    if (!held) {
      return absl::DataLossError(absl::StrCat(where, ": metadata key ", Quoted(it->first),
                                              " names no tensor of the file"));
    }
    m.parts[name] = it->second;
  }
  return m;
}

// The persisted tensors, each checked against its recorded v1 digest (v2 computed), manifest order.
absl::StatusOr<std::vector<BaselineTensor>> LoadPersistedTensors(const model::SafetensorsFile& file,
                                                                 const PersistedMeta& meta,
                                                                 const std::string& where,
                                                                 int threads) {
  const auto& entries = file.tensors();
  std::vector<BaselineTensor> tensors;
  tensors.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const model::SafetensorsEntry& e = entries[i];
    const std::string what =
        absl::StrCat(where, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), e.name));
    uint64_t want = 0;
    if (!ParseHex64(meta.digests[i], &want)) {
      return absl::DataLossError(absl::StrCat(what, ": bad digest ", Quoted(meta.digests[i])));
    }
    BaselineTensor t;
    t.spec.set_name(e.name);
    t.spec.set_dtype(sync::ToProtoDType(e.dtype));
    for (int64_t d : e.shape) t.spec.add_shape(static_cast<uint64_t>(d));
    if (auto part = meta.parts.find(e.name); part != meta.parts.end()) {
      if (!ParsePart(part->second, e.name, &t.spec)) {
        return absl::DataLossError(absl::StrCat(what, ": bad part ", Quoted(part->second)));
      }
      if (absl::Status st = sync::ValidateTensorSpec(t.spec); !st.ok()) {
        return AnnotateAs(absl::StatusCode::kDataLoss, st, what);
      }
    }
    t.dtype = e.dtype;
    std::span<const uint8_t> data = file.data(i);
    auto bytes = std::make_shared<std::vector<uint8_t>>(data.begin(), data.end());
    t.digest = TensorDigest(*bytes, threads);
    if (t.digest != want) {
      return absl::DataLossError(absl::StrCat(what, ": digest ", Hex64(t.digest),
                                              " does not match the recorded ", Hex64(want),
                                              " (corrupt file)"));
    }
    t.digest_v2 = TensorDigestV2(*bytes, threads);
    t.bytes = std::move(bytes);
    tensors.push_back(std::move(t));
  }
  std::sort(tensors.begin(), tensors.end(), [](const BaselineTensor& a, const BaselineTensor& b) {
    return sync::SpecBefore(a.spec, b.spec);
  });
  std::vector<v1::TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const BaselineTensor& t : tensors) specs.push_back(t.spec);
  if (absl::Status st = sync::ValidateManifest(specs); !st.ok()) {
    return AnnotateAs(absl::StatusCode::kDataLoss, st, where);
  }
  return tensors;
}

}  // namespace

absl::StatusOr<PersistedBaseline> ReadBaselineFile(const std::string& path,
                                                   const std::string& where, int threads) {
  auto file = model::SafetensorsFile::Open(path);
  if (!file.ok()) {
    return AnnotateAs(absl::StatusCode::kDataLoss, file.status(), where);
  }
  REFIT_ASSIGN_OR_RETURN(const PersistedMeta meta, ParsePersistedMeta(*file, where));
  PersistedBaseline out;
  out.version = meta.version;
  out.version_digest = meta.version_digest;
  out.snapshot_unix_nanos = meta.snapshot_unix_nanos;
  out.lineage = meta.lineage;
  REFIT_ASSIGN_OR_RETURN(out.tensors, LoadPersistedTensors(*file, meta, where, threads));
  return out;
}

absl::Status WriteBaselineFile(const std::string& path, const BaselineSnapshot& s, bool durable) {
  std::vector<model::SafetensorsTensorRef> refs;
  std::vector<std::string> digests;
  refs.reserve(s.tensors.size());
  std::map<std::string, std::string> meta;
  for (size_t k = 0; k < s.tensors.size(); ++k) {
    const BaselineTensor& t = s.tensors[k];
    model::SafetensorsTensorRef r;
    r.name = EntryName(s.tensors, k);
    if (sync::IsPart(t.spec))
      meta[absl::StrCat(kMetaPartPrefix, r.name)] = EncodePart(t.spec, r.name);
    r.dtype = t.dtype;
    for (uint64_t d : t.spec.shape()) r.shape.push_back(static_cast<int64_t>(d));
    r.data = *t.bytes;
    refs.push_back(std::move(r));
    digests.push_back(Hex64(t.digest));
  }
  meta[kMetaFormat] = std::string(kFormatValue);
  meta[kMetaVersion] = absl::StrCat(s.version);
  meta[kMetaVersionDigest] = Hex64(s.version_digest);
  meta[kMetaDigests] = absl::StrJoin(digests, ",");
  meta[kMetaSnapshot] = absl::StrCat(s.snapshot_unix_nanos);
  meta[kMetaLineage] = Hex64(s.lineage);
  SafeWriteOptions write;
  write.durable = durable;
  return model::WriteSafetensors(path, refs, meta, write);
}

}  // namespace refit::publisher

// libFuzzer target for the strict YAML config loader (config.h, yaml_proto.h) on arbitrary text.
//
// The input is a config file's text, loaded for both roles (LoadPublisherConfigFromString,
// LoadSubscriberConfigFromString) and as a whole (LoadConfigFileFromString): schema mapping,
// defaults and every cross-field rule. Any error is fine when it is one line with code
// INVALID_ARGUMENT; a crash, an escaped exception, a sanitizer report or a violated invariant
// (abort) is a finding. Invariants:
//   - a section that validates as part of the whole file validates alone, to the same message;
//   - a config that loads renders (ConfigToYaml) to text that loads back to an equal message.
// Files named by the config (TLS PEM files) are never touched (CheckConfigFiles is not called).
// Build: cmake -DREFIT_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ ...; run: config_fuzzer DIR
// (seeds: the examples in config/).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "daemon/config/config.h"
#include "google/protobuf/util/message_differencer.h"

namespace {

using google::protobuf::util::MessageDifferencer;

void Check(bool ok) {
  if (!ok) abort();
}

// A rejected config: one line, what and where, INVALID_ARGUMENT (text needs no file access).
void CheckError(const absl::Status& st) {
  Check(absl::IsInvalidArgument(st));
  Check(!st.message().empty() && st.message().find('\n') == absl::string_view::npos);
}

template <typename Config, typename Load>
void CheckRoundTrip(const Config& config, Load load) {
  auto back = load(refit::config::ConfigToYaml(config), "<round trip>");
  Check(back.ok());
  Check(MessageDifferencer::Equals(*back, config));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > refit::config::kMaxConfigBytes) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto file = refit::config::LoadConfigFileFromString(text, "fuzz.yaml");
  auto pub = refit::config::LoadPublisherConfigFromString(text, "fuzz.yaml");
  auto sub = refit::config::LoadSubscriberConfigFromString(text, "fuzz.yaml");
  if (!file.ok()) CheckError(file.status());
  if (!pub.ok()) CheckError(pub.status());
  if (!sub.ok()) CheckError(sub.status());
  if (file.ok() && file->has_publisher()) {
    Check(pub.ok() && MessageDifferencer::Equals(*pub, file->publisher()));
  }
  if (file.ok() && file->has_subscriber()) {
    Check(sub.ok() && MessageDifferencer::Equals(*sub, file->subscriber()));
  }
  if (pub.ok()) CheckRoundTrip(*pub, refit::config::LoadPublisherConfigFromString);
  if (sub.ok()) CheckRoundTrip(*sub, refit::config::LoadSubscriberConfigFromString);
  return 0;
}

#include "daemon/common/logging.h"

#include <atomic>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace refit {
namespace {

struct Registry {
  absl::Mutex mu;
  spdlog::sink_ptr sink;
  std::atomic<int> level{spdlog::level::info};
};

Registry& GetRegistry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    reg->sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    reg->sink->set_formatter(std::make_unique<spdlog::pattern_formatter>(
        "%Y-%m-%dT%H:%M:%S.%fZ %L %n: %v", spdlog::pattern_time_type::utc));
    return reg;
  }();
  return *r;
}

}  // namespace

std::shared_ptr<spdlog::logger> Logger(const std::string& component) {
  Registry& reg = GetRegistry();
  absl::MutexLock lock(&reg.mu);
  if (auto existing = spdlog::get(component)) return existing;
  auto logger = std::make_shared<spdlog::logger>(component, reg.sink);
  logger->set_level(static_cast<spdlog::level::level_enum>(reg.level.load()));
  logger->flush_on(spdlog::level::info);
  spdlog::register_logger(logger);
  return logger;
}

void SetLogLevel(spdlog::level::level_enum level) {
  Registry& reg = GetRegistry();
  absl::MutexLock lock(&reg.mu);
  reg.level.store(level);
  spdlog::apply_all([level](const std::shared_ptr<spdlog::logger>& l) { l->set_level(level); });
}

absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "trace") return spdlog::level::trace;
  if (t == "debug") return spdlog::level::debug;
  if (t == "info") return spdlog::level::info;
  if (t == "warn" || t == "warning") return spdlog::level::warn;
  if (t == "error") return spdlog::level::err;
  if (t == "critical") return spdlog::level::critical;
  if (t == "off") return spdlog::level::off;
  return absl::InvalidArgumentError(absl::StrCat(
      "log level \"", text, "\" is not one of trace, debug, info, warn, error, critical, off"));
}

spdlog::level::level_enum LogLevelFromConfig(int v) {
  switch (v) {
    case 1: return spdlog::level::trace;
    case 2: return spdlog::level::debug;
    case 3: return spdlog::level::info;
    case 4: return spdlog::level::warn;
    case 5: return spdlog::level::err;
    case 6: return spdlog::level::critical;
    case 7: return spdlog::level::off;
    default: return spdlog::level::info;
  }
}

}  // namespace refit

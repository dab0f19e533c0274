#include "daemon/common/logging.h"

#include <algorithm>
#include <atomic>

#include <cmath>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/json_string.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace refit {
namespace {

struct Registry {
  absl::Mutex mu;
  spdlog::sink_ptr sink;
  std::atomic<int> level{spdlog::level::info};
};

std::unique_ptr<spdlog::formatter> TextFormatter() {
  return std::make_unique<spdlog::pattern_formatter>("%Y-%m-%dT%H:%M:%S.%fZ %L %n: %v",
                                                     spdlog::pattern_time_type::utc);
}

Registry& GetRegistry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    reg->sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    reg->sink->set_formatter(TextFormatter());
    return reg;
  }();
  return *r;
}

// The fields of the LogEvent being logged on this thread (the sink formats in the caller's
// thread), or null.
thread_local const std::vector<LogField>* t_event_fields = nullptr;

const char* LevelName(spdlog::level::level_enum l) {
  switch (l) {
    case spdlog::level::trace: return "trace";
    case spdlog::level::debug: return "debug";
    case spdlog::level::info: return "info";
    case spdlog::level::warn: return "warn";
    case spdlog::level::err: return "error";
    case spdlog::level::critical: return "critical";
    default: return "off";
  }
}

std::string JsonValue(const LogField& f) {
  struct Visit {
    std::string operator()(const std::string& s) const { return JsonString(s); }
    std::string operator()(int64_t v) const { return absl::StrCat(v); }
    std::string operator()(uint64_t v) const { return absl::StrCat(v); }
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(double v) const {
      if (!std::isfinite(v)) return "null";
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.6g", v);
      return buf;
    }
  };
  return std::visit(Visit{}, f.value);
}

// One JSON object per line: ts, level, logger, msg, then the event's fields.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const absl::Time t = absl::FromChrono(msg.time);
    std::string out = absl::StrCat(
        "{\"ts\":\"", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone()),
        "\",\"level\":\"", LevelName(msg.level), "\",\"logger\":",
        JsonString(absl::string_view(msg.logger_name.data(), msg.logger_name.size())),
        ",\"msg\":", JsonString(absl::string_view(msg.payload.data(), msg.payload.size())));
    if (t_event_fields != nullptr) {
      for (const LogField& f : *t_event_fields) {
        absl::StrAppend(&out, ",", JsonString(f.key), ":", JsonValue(f));
      }
    }
    out.append("}\n");
    dest.append(out.data(), out.data() + out.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

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

void SetLogFormat(LogFormat format) {
  Registry& reg = GetRegistry();
  absl::MutexLock lock(&reg.mu);
  if (format == LogFormat::kJson) {
    reg.sink->set_formatter(std::make_unique<JsonFormatter>());
  } else {
    reg.sink->set_formatter(TextFormatter());
  }
}

LogFormat LogFormatFromConfig(int v) { return v == 2 ? LogFormat::kJson : LogFormat::kText; }

void LogEvent(spdlog::logger& log, spdlog::level::level_enum level, absl::string_view message,
              const std::vector<LogField>& fields) {
  if (!log.should_log(level)) return;
  t_event_fields = &fields;
  log.log(level, "{}", fmt::string_view(message.data(), message.size()));
  t_event_fields = nullptr;
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

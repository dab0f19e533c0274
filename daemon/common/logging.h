// Logging: spdlog with one named logger per component, all writing to stderr through one sink
// (systemd's journal and kubectl logs both read stderr). The level comes from the config's
// log_level (refitd --log-level overrides) and applies to every component.
//
//   auto log = refit::Logger("dataplane");
//   log->info("session {} from {}: hello version {}", id, peer, version);
//
// Components in use: refitd, publisher, dataplane, upstream, subscriber, control, trainer-api,
// consumer-api, peers. Formats (config log_format): text, "2026-11-30T00:41:12.345678Z I
// dataplane: message"; json, one object per line: {"ts":"2026-11-30T00:41:12.345678Z",
// "level":"info","logger":"dataplane","msg":"message"} plus, for events logged with LogEvent
// (the per-refit lines), their fields as keys.
#ifndef REFIT_DAEMON_COMMON_LOGGING_H_
#define REFIT_DAEMON_COMMON_LOGGING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/common/printable.h"  // Printable, Quoted: for what reaches a log line
#include "spdlog/spdlog.h"

namespace refit {

// The logger named `component`, created on first use with the shared sink and the current
// level. Thread-safe; cheap after the first call for a name (keep the shared_ptr around).
std::shared_ptr<spdlog::logger> Logger(const std::string& component);

// Sets the level of every existing and future logger.
void SetLogLevel(spdlog::level::level_enum level);

enum class LogFormat { kText, kJson };
// Sets the line format of every logger (they share one sink).
void SetLogFormat(LogFormat format);
// Maps a config LogFormat enum value (refit.v1.LogFormat: 1 text, 2 json); unknown -> text.
LogFormat LogFormatFromConfig(int config_log_format);

// One field of a structured log event. Keys are the caller's constants (not "ts", "level",
// "logger" or "msg"); string values are escaped, doubles that are not finite become null.
struct LogField {
  std::string key;
  std::variant<std::string, int64_t, uint64_t, double, bool> value;
};

// Logs `message` at `level`: in the text format the message alone, in the JSON format one object
// with the message and `fields` as keys (so a log pipeline reads the numbers without parsing the
// text).
void LogEvent(spdlog::logger& log, spdlog::level::level_enum level, absl::string_view message,
              const std::vector<LogField>& fields);

// Parses "trace|debug|info|warn|error|critical|off" (case-insensitive). InvalidArgument naming
// the accepted values otherwise.
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view text);

// Maps a config LogLevel enum value (refit.v1.LogLevel, 1..7) to spdlog's; unknown -> info.
spdlog::level::level_enum LogLevelFromConfig(int config_log_level);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_LOGGING_H_

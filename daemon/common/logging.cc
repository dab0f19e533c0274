#include "daemon/common/logging.h"

#include <algorithm>
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

size_t Utf8CharLength(absl::string_view text, size_t i, uint32_t* code_point) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c0 = b(i);
  const size_t n = c0 < 0x80 ? 1
                   : (c0 >> 5) == 0x6 ? 2
                   : (c0 >> 4) == 0xe ? 3
                   : (c0 >> 3) == 0x1e ? 4
                                        : 0;
  if (n == 0 || i + n > text.size()) return 0;
  uint32_t v = n == 1 ? c0 : (c0 & (0x7f >> n));
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    v = (v << 6) | (b(i + k) & 0x3f);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[n] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
  *code_point = v;
  return n;
}

std::string Printable(absl::string_view text, size_t max_bytes) {
  std::string out;
  const size_t end = std::min(text.size(), max_bytes);
  for (size_t i = 0; i < end;) {
    uint32_t cp = 0;
    const size_t n = Utf8CharLength(text, i, &cp);
    if (n == 0 || IsControlCodePoint(cp) || cp == '\\') {
      const size_t bytes = n == 0 ? 1 : n;
      for (size_t k = 0; k < bytes; ++k) {
        const unsigned char c = static_cast<unsigned char>(text[i + k]);
        switch (c) {
          case '\n': out.append("\\n"); break;
          case '\r': out.append("\\r"); break;
          case '\t': out.append("\\t"); break;
          case '\\': out.append("\\\\"); break;
          default: absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
        }
      }
      i += bytes;
      continue;
    }
    out.append(text.data() + i, n);
    i += n;
  }
  if (end < text.size()) out.append("...");
  return out;
}

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

// Status propagation: REFIT_RETURN_IF_ERROR / REFIT_ASSIGN_OR_RETURN for absl::Status and
// absl::StatusOr, and the one way to add context to a failed status, refit::Annotate (AnnotateAs
// when the code changes too).
//
// Debian 12's abseil (20220623) predates ABSL_RETURN_IF_ERROR, so refitd carries its own.
#ifndef REFIT_DAEMON_COMMON_STATUS_MACROS_H_
#define REFIT_DAEMON_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace refit {

// Annotate (below) with another code: for a failure whose meaning changes as it travels up (a parse
// error, INVALID_ARGUMENT where it was found, is DATA_LOSS for the file it was read from). The
// context and payloads as Annotate; OK stays OK.
template <typename... Context>
absl::Status AnnotateAs(absl::StatusCode code, const absl::Status& status,
                        const Context&... context) {
  if (status.ok()) return status;
  absl::Status out(code, absl::StrCat(context..., ": ", status.message()));
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// Annotate(status, context...): the status with "<context>: " before its message (the context's
// parts are joined as by absl::StrCat), the same code and payloads. OK stays OK. The project's
// one idiom for saying where a failure happened as it travels up:
//   return Annotate(st, "tensor ", name);  // -> "tensor w1: checksum mismatch"
template <typename... Context>
absl::Status Annotate(const absl::Status& status, const Context&... context) {
  return AnnotateAs(status.code(), status, context...);
}

}  // namespace refit

#define REFIT_STATUS_CONCAT_INNER_(a, b) a##b
#define REFIT_STATUS_CONCAT_(a, b) REFIT_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if not OK.
#define REFIT_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status refit_status_ = (expr);         \
    if (!refit_status_.ok()) return refit_status_; \
  } while (0)

// REFIT_ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns the
// status from the enclosing function, otherwise moves the value into `lhs` (which may be a
// declaration such as `auto x`).
#define REFIT_ASSIGN_OR_RETURN(lhs, expr) \
  REFIT_ASSIGN_OR_RETURN_IMPL_(REFIT_STATUS_CONCAT_(refit_statusor_, __LINE__), lhs, expr)

#define REFIT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // REFIT_DAEMON_COMMON_STATUS_MACROS_H_

// A minimal HTTP/1.0 GET over TCP, for reading a metrics endpoint without a Prometheus server:
// `refitctl metrics` and the tests. Numeric hosts only ("127.0.0.1:9400", "[::1]:9400"); the
// response must carry Content-Length or end at connection close (no chunked encoding).
#ifndef REFIT_DAEMON_METRICS_HTTP_GET_H_
#define REFIT_DAEMON_METRICS_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace refit::metrics {

struct HttpResponse {
  int status = 0;            // 200, 404, ...
  std::string content_type;  // the Content-Type header ("" if absent)
  std::string body;
};

// GET http://<host_port><path>. Errors name the URL: Unavailable (cannot connect, connection
// broken), DeadlineExceeded (no complete answer within `timeout`), InvalidArgument (bad
// address), DataLoss (not an HTTP response, or larger than `max_bytes`).
absl::StatusOr<HttpResponse> HttpGet(const std::string& host_port, const std::string& path,
                                     absl::Duration timeout, size_t max_bytes = 64 << 20);

}  // namespace refit::metrics

#endif  // REFIT_DAEMON_METRICS_HTTP_GET_H_

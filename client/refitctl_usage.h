// refitctl's help texts: `refitctl --help` and `refitctl VERB --help`.
#ifndef REFIT_CLIENT_REFITCTL_USAGE_H_
#define REFIT_CLIENT_REFITCTL_USAGE_H_

namespace refit::client {

extern const char kMainUsage[];
extern const char kStatusUsage[];
extern const char kMetricsUsage[];
extern const char kPublishUsage[];
extern const char kExportUsage[];
extern const char kWaitUsage[];
extern const char kVerifyUsage[];
extern const char kResyncUsage[];

}  // namespace refit::client

#endif  // REFIT_CLIENT_REFITCTL_USAGE_H_

#include "daemon/config/yaml_proto.h"

#include <string>

#include "daemon/common/status_matchers.h"
#include "google/protobuf/util/message_differencer.h"
#include "google/protobuf/wrappers.pb.h"
#include "gtest/gtest.h"
#include "refit/v1/config.pb.h"
#include "refit/v1/data.pb.h"
#include "refit/v1/local.pb.h"
#include "refit/v1/options.pb.h"

namespace refit::config {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::util::MessageDifferencer;
using ::refit::testing::IsOk;

absl::Status Parse(const std::string& yaml, Message* msg) {
  SourceMap map("test.yaml");
  return ParseYamlInto(yaml, msg, &map);
}

// Parses into a fresh message of type M and returns the error message ("" when OK).
template <typename M>
std::string ErrorOf(const std::string& yaml) {
  M msg;
  absl::Status s = Parse(yaml, &msg);
  if (s.ok()) return "";
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << "not one line: " << s;
  return std::string(s.message());
}

#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected to find [" << (needle) << "] in [" << (haystack) << "]"

TEST(YamlProtoTest, NestedMessagesSequencesAndScalars) {
  v1::ConfigFile file;
  ASSERT_THAT(Parse(R"(
subscriber:
  name: rollout-0
  log_level: debug
  upstream:
    addresses: ["127.0.0.2:7000", "localhost:701"]
    connections: 4
    backoff: {initial_ms: 5, multiplier: 1.5, jitter: 0}
  serve_peers: true
  staging:
    max_bytes: 18446744073709551615
)",
                    &file),
              IsOk());
  const v1::SubscriberConfig& s = file.subscriber();
  EXPECT_EQ(s.name(), "rollout-0");
  EXPECT_EQ(s.log_level(), v1::LOG_LEVEL_DEBUG);
  ASSERT_EQ(s.upstream().addresses_size(), 2);
  EXPECT_EQ(s.upstream().addresses(1), "localhost:701");
  EXPECT_EQ(s.upstream().connections(), 4u);
  EXPECT_EQ(s.upstream().backoff().initial_ms(), 5u);
  EXPECT_DOUBLE_EQ(s.upstream().backoff().multiplier(), 1.5);
  EXPECT_TRUE(s.upstream().backoff().has_jitter());
  EXPECT_EQ(s.upstream().backoff().jitter(), 0.0);
  EXPECT_FALSE(s.upstream().backoff().has_max_ms());
  EXPECT_TRUE(s.serve_peers());
  EXPECT_EQ(s.staging().max_bytes(), UINT64_MAX);
  EXPECT_FALSE(file.has_publisher());
}

TEST(YamlProtoTest, UnknownKeyNamesPathLineAndSuggestion) {
  const std::string e = ErrorOf<v1::ConfigFile>(
      "publisher:\n"
      "  listen: \"127.0.0.1:1\"\n"
      "  tls:\n"
      "    cret: /x.pem\n");
  EXPECT_CONTAINS(e, "test.yaml:4:5: publisher.tls.cret: unknown key (did you mean \"cert\"?)");
  EXPECT_CONTAINS(e, "expected one of: cert, key, ca, allowed_identities, insecure");
  // No suggestion when nothing is close.
  EXPECT_EQ(ErrorOf<v1::ConfigFile>("zebra: 1\n").find("did you mean"), std::string::npos);
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("zebra: 1\n"), "test.yaml:1:1: zebra: unknown key");
}

TEST(YamlProtoTest, DuplicateKeys) {
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher:\n  listen: a\n  name: x\n  listen: b\n"),
                  "test.yaml:4:3: publisher.listen: duplicate key (first at line 2)");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher: {listen: a}\npublisher: {listen: a}\n"),
                  "test.yaml:2:1: publisher: duplicate key (first at line 1)");
}

TEST(YamlProtoTest, WrongTypes) {
  EXPECT_CONTAINS(ErrorOf<v1::PublisherTransport>("frame_bytes: 4MiB\n"),
                  "test.yaml:1:14: frame_bytes: expected an unsigned 32-bit integer (decimal "
                  "digits), got \"4MiB\"");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherTransport>("frame_bytes: \"4194304\"\n"),
                  "frame_bytes: expected an unsigned 32-bit integer, got the quoted string "
                  "\"4194304\" (remove the quotes)");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherTransport>("frame_bytes: [1]\n"),
                  "frame_bytes: expected an unsigned 32-bit integer, got a sequence");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherTransport>("frame_bytes: {a: 1}\n"),
                  "frame_bytes: expected an unsigned 32-bit integer, got a mapping");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("tls: /x.pem\n"),
                  "tls: expected a mapping, got \"/x.pem\"");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("listen: [a, b]\n"),
                  "listen: expected a string, got a sequence");
  EXPECT_CONTAINS(
      ErrorOf<v1::UpstreamConfig>("addresses: \"127.0.0.1:1\"\n"),
      "addresses: expected a sequence of strings, got the quoted string \"127.0.0.1:1\"");
  EXPECT_CONTAINS(ErrorOf<v1::UpstreamConfig>("addresses: [\"a:1\", {x: 1}]\n"),
                  "addresses[1]: expected a string, got a mapping");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("- publisher\n"),
                  "test.yaml:1:1: : expected a mapping, got a sequence");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("? [a, b]\n: 1\n"), "keys must be names");
}

TEST(YamlProtoTest, StringsAcceptPlainAndQuotedScalars) {
  v1::PublisherConfig p;
  ASSERT_THAT(Parse("name: 007\nlisten: 'true'\nlocal_socket: \"\"\n", &p), IsOk());
  EXPECT_EQ(p.name(), "007");
  EXPECT_EQ(p.listen(), "true");
  EXPECT_TRUE(p.has_local_socket());
  EXPECT_EQ(p.local_socket(), "");
}

TEST(YamlProtoTest, NullsAreErrors) {
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("name:\n"),
                  "test.yaml:1:1: name: expected a string, got null (write \"\" for an empty "
                  "string)");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("name: ~\n"), "got null");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("tls:\n"),
                  "tls: expected a mapping, got null (write {} for an empty one)");
  EXPECT_CONTAINS(ErrorOf<v1::UpstreamConfig>("addresses:\n"),
                  "addresses: expected a sequence of strings, got null");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherTransport>("frame_bytes: null\n"), "got null");
}

TEST(YamlProtoTest, BooleansAreStrict) {
  v1::ServerTls tls;
  ASSERT_THAT(Parse("insecure: true\n", &tls), IsOk());
  EXPECT_TRUE(tls.insecure());
  ASSERT_THAT(Parse("insecure: false\n", &(tls = {})), IsOk());
  EXPECT_TRUE(tls.has_insecure());
  for (const char* bad : {"yes", "no", "on", "True", "1", "y"}) {
    EXPECT_CONTAINS(ErrorOf<v1::ServerTls>(std::string("insecure: ") + bad + "\n"),
                    std::string("insecure: expected true or false, got \"") + bad + "\"");
  }
  EXPECT_CONTAINS(ErrorOf<v1::ServerTls>("insecure: \"true\"\n"), "remove the quotes");
}

TEST(YamlProtoTest, IntegerRangesOfEveryWidth) {
  google::protobuf::Int32Value i32;
  ASSERT_THAT(Parse("value: -2147483648\n", &i32), IsOk());
  EXPECT_EQ(i32.value(), INT32_MIN);
  EXPECT_CONTAINS(ErrorOf<google::protobuf::Int32Value>("value: 2147483648\n"),
                  "value: 2147483648 is out of range for a 32-bit integer [-2147483648, "
                  "2147483647]");
  google::protobuf::Int64Value i64;
  ASSERT_THAT(Parse("value: -9223372036854775808\n", &i64), IsOk());
  EXPECT_EQ(i64.value(), INT64_MIN);
  EXPECT_CONTAINS(ErrorOf<google::protobuf::Int64Value>("value: 9223372036854775808\n"),
                  "out of range for a 64-bit integer");
  EXPECT_CONTAINS(ErrorOf<google::protobuf::UInt32Value>("value: -1\n"),
                  "value: -1 is out of range for an unsigned 32-bit integer [0, 4294967295]");
  EXPECT_CONTAINS(ErrorOf<google::protobuf::UInt32Value>("value: 4294967296\n"),
                  "out of range for an unsigned 32-bit integer");
  EXPECT_CONTAINS(ErrorOf<google::protobuf::UInt64Value>("value: 18446744073709551616\n"),
                  "out of range for an unsigned 64-bit integer");
  EXPECT_CONTAINS(ErrorOf<google::protobuf::UInt64Value>("value: 0x10\n"), "decimal digits");
  EXPECT_CONTAINS(ErrorOf<google::protobuf::UInt64Value>("value: 1e3\n"), "decimal digits");
  EXPECT_CONTAINS(ErrorOf<google::protobuf::UInt64Value>("value: 1_000\n"), "decimal digits");
  EXPECT_CONTAINS(ErrorOf<google::protobuf::UInt64Value>("value: +5\n"), "decimal digits");
}

TEST(YamlProtoTest, SchemaBoundsFromRules) {
  EXPECT_CONTAINS(ErrorOf<v1::PublisherTransport>("\n\nframe_bytes: 1024\n"),
                  "test.yaml:3:14: frame_bytes: 1024 is out of range [65536, 67108864]");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherTransport>("frame_bytes: 67108865\n"),
                  "67108865 is out of range [65536, 67108864]");
  v1::PublisherTransport t;
  ASSERT_THAT(Parse("frame_bytes: 65536\n", &t), IsOk());
  ASSERT_THAT(Parse("frame_bytes: 67108864\n", &(t = {})), IsOk());
  EXPECT_CONTAINS(ErrorOf<v1::CodecConfig>("block_log2: 7\n"), "7 is out of range [8, 24]");
  EXPECT_CONTAINS(ErrorOf<v1::BackoffConfig>("multiplier: 0.5\n"),
                  "multiplier: 0.5 is out of range [1.0, 10.0]");
  EXPECT_CONTAINS(ErrorOf<v1::BackoffConfig>("jitter: 1.01\n"), "out of range [0.0, 1.0]");
}

TEST(YamlProtoTest, FloatingPoint) {
  v1::BackoffConfig b;
  ASSERT_THAT(Parse("multiplier: 2\njitter: 5e-1\n", &b), IsOk());
  EXPECT_EQ(b.multiplier(), 2.0);
  EXPECT_EQ(b.jitter(), 0.5);
  for (const char* bad : {".inf", "nan", ".nan", "inf", "1.5x", "0x1p3", "", "1e"}) {
    const std::string e = ErrorOf<v1::BackoffConfig>(std::string("multiplier: '") + bad + "'\n");
    EXPECT_CONTAINS(e, "multiplier: ");  // quoted: rejected for being a string
  }
  EXPECT_CONTAINS(ErrorOf<v1::BackoffConfig>("multiplier: .inf\n"),
                  "expected a decimal number, got \".inf\"");
  EXPECT_CONTAINS(ErrorOf<v1::BackoffConfig>("multiplier: 1e999\n"), "1e999 is out of range");
  google::protobuf::FloatValue f;
  EXPECT_CONTAINS(ErrorOf<google::protobuf::FloatValue>("value: 1e39\n"), "out of range");
  ASSERT_THAT(Parse("value: -1.25\n", &f), IsOk());
  EXPECT_EQ(f.value(), -1.25f);
}

TEST(YamlProtoTest, Enums) {
  // PublisherConfig requires `listen`.
  v1::PublisherConfig p;
  ASSERT_THAT(Parse("listen: a\nlog_level: warn\n", &p), IsOk());
  EXPECT_EQ(p.log_level(), v1::LOG_LEVEL_WARN);
  ASSERT_THAT(Parse("listen: a\nlog_level: ERROR\n", &(p = {})), IsOk());
  EXPECT_EQ(p.log_level(), v1::LOG_LEVEL_ERROR);
  ASSERT_THAT(Parse("listen: a\nlog_level: LOG_LEVEL_TRACE\n", &(p = {})), IsOk());
  EXPECT_EQ(p.log_level(), v1::LOG_LEVEL_TRACE);
  ASSERT_THAT(Parse("listen: a\nlog_level: 'off'\n", &(p = {})), IsOk());
  EXPECT_EQ(p.log_level(), v1::LOG_LEVEL_OFF);
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("log_level: verbose\n"),
                  "test.yaml:1:12: log_level: unknown value \"verbose\"; expected one of: trace, "
                  "debug, info, warn, error, critical, off");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("log_level: unspecified\n"), "unknown value");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("log_level: LOG_LEVEL_UNSPECIFIED\n"),
                  "unknown value");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("log_level: 3\n"), "unknown value \"3\"");
  v1::CodecConfig c;
  ASSERT_THAT(Parse("device: cuda\n", &c), IsOk());
  EXPECT_EQ(c.device(), v1::DEVICE_CUDA);
  v1::StoreConfig s;
  ASSERT_THAT(Parse("kind: shm\n", &s), IsOk());
  EXPECT_EQ(s.kind(), v1::STORE_KIND_SHM);
}

TEST(YamlProtoTest, RepeatedMessagesAndOneofs) {
  v1::VersionHeader h;
  const absl::Status st = Parse(R"(
version: 7
tensors:
  - spec: {name: w, dtype: bf16, shape: [2, 3]}
    delivery: patch
    steps: [{base_version: 5, target_version: 6}, {base_version: 6, target_version: 7}]
  - spec: {name: x, dtype: DTYPE_F32}
    delivery: keyframe
)",
                                &h);
  ASSERT_THAT(st, IsOk());
  ASSERT_EQ(h.tensors_size(), 2);
  EXPECT_EQ(h.tensors(0).spec().shape_size(), 2);
  EXPECT_EQ(h.tensors(0).steps(1).target_version(), 7u);
  EXPECT_EQ(h.tensors(1).spec().dtype(), v1::DTYPE_F32);
  EXPECT_CONTAINS(ErrorOf<v1::VersionHeader>("tensors:\n  - spec: {name: w, shape: [1, -2]}\n"),
                  "test.yaml:2:32: tensors[0].spec.shape[1]: -2 is out of range");

  EXPECT_CONTAINS(ErrorOf<v1::ShmRegion>("shm_name: /a\npath: /dev/shm/a\n"),
                  "test.yaml:2:1: path: cannot be combined with 'shm_name' (only one of them "
                  "may be set)");
  v1::ShmRegion r;
  ASSERT_THAT(Parse("path: /dev/shm/a\noffset: 4096\n", &r), IsOk());
  EXPECT_EQ(r.object_case(), v1::ShmRegion::kPath);
}

TEST(YamlProtoTest, RequiredKeys) {
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher:\n  name: x\n"),
                  "test.yaml:2:3: publisher.listen: required key is missing");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher: {}\n"),
                  "publisher.listen: required key is missing");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher:\n  listen: \"\"\n"),
                  "test.yaml:2:11: publisher.listen: must not be empty");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("subscriber:\n  listen: \"127.0.0.1:1\"\n"),
                  "subscriber.upstream: required key is missing");
  // In a repeated message (upstream.addresses itself is checked by the config rules: it or
  // upstream.shards).
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("subscriber:\n  upstream: {shards: [{}]}\n"),
                  "subscriber.upstream.shards[0].addresses: required key is missing");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("subscriber:\n  upstream: {shards: [{addresses: []}]}\n"),
                  "subscriber.upstream.shards[0].addresses: must not be empty");
  // Required keys of an absent section are not required.
  v1::ConfigFile file;
  EXPECT_THAT(Parse("publisher: {listen: \"127.0.0.1:1\"}\n", &file), IsOk());
}

// Found by config_fuzzer: yaml-cpp 0.7's LoadAll never returned (allocating without bound) on a
// stray ',' outside any collection.
TEST(YamlProtoTest, StrayCommaIsASyntaxErrorNotAHang) {
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>(",# A#"),
                  "test.yaml:1:1: YAML syntax error: no YAML node can start here");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>(","), "test.yaml:1:1: YAML syntax error");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("\n  ,\n"), "test.yaml:2:3: YAML syntax error");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher: {}\n,\n"), "test.yaml:");
}

// Found by config_fuzzer: yaml-cpp's "unknown escape character: " message ends with the
// character (for a NUL byte in a plain scalar, a line break), which made the error two lines and
// quoted the file.
TEST(YamlProtoTest, UnknownEscapeErrorIsOneLineWithoutTheCharacter) {
  const std::string nul("publisher:\n  name: a\0\n", 22);
  for (const std::string& text : {nul, std::string("publisher:\n  name: \"a\\\x01\"\n")}) {
    const std::string e = ErrorOf<v1::ConfigFile>(text);
    EXPECT_CONTAINS(e, ": YAML syntax error: unknown escape character");
    EXPECT_EQ(e.find_first_of(std::string("\n\x01", 2)), std::string::npos) << e;
    EXPECT_EQ(e.find("character:"), std::string::npos) << e;
  }
}

// Found by config_fuzzer: a key with a control character in it (yaml-cpp reads a NUL byte and
// the next character of a key as a line break) went into the error's field path as it was, so
// the error had two lines.
TEST(YamlProtoTest, ControlCharactersInKeysAreEscapedInErrors) {
  const std::string e = ErrorOf<v1::ConfigFile>(std::string("publisher:\n  \0name: x\n", 22));
  EXPECT_CONTAINS(e, "test.yaml:2:3: publisher.");
  EXPECT_CONTAINS(e, "unknown key");
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

TEST(YamlProtoTest, DocumentLevelErrors) {
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>(""), "test.yaml: the configuration is empty");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("# only a comment\n"), "the configuration is empty");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("---\n...\n"), "the configuration is empty");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher: {}\n---\nsubscriber: {}\n"),
                  "test.yaml:3:1: a second YAML document");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher:\n  listen: [a\n"),
                  "test.yaml:3:1: YAML syntax error: ");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("publisher:\n  listen: {a: 1\n"), "YAML syntax error");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>("a: b: c\n"), "YAML syntax error");
  EXPECT_CONTAINS(ErrorOf<v1::PublisherConfig>("name: !!str x\n"),
                  "name: explicit YAML tags are not supported (tag:yaml.org,2002:str)");
  EXPECT_CONTAINS(ErrorOf<v1::ConfigFile>(std::string(kMaxConfigBytes + 1, '#')),
                  "a config may be at most 1048576");
}

TEST(YamlProtoTest, HostileNestingDoesNotCrash) {
  // Deeper than any schema: either yaml-cpp refuses it or the walker reports a type error.
  const std::string deep = "publisher: " + std::string(5000, '[') + std::string(5000, ']') + "\n";
  EXPECT_NE(ErrorOf<v1::ConfigFile>(deep), "");
  const std::string deep_map = "publisher: " + std::string(3000, '{') + std::string(3000, '}');
  EXPECT_NE(ErrorOf<v1::ConfigFile>(deep_map), "");
}

TEST(YamlProtoTest, AliasesResolve) {
  v1::UpstreamConfig u;
  ASSERT_THAT(Parse("addresses: [&p \"127.0.0.1:1\"]\nbootstrap_peers: [*p]\n", &u), IsOk());
  EXPECT_EQ(u.bootstrap_peers(0), "127.0.0.1:1");
}

TEST(YamlProtoTest, ApplyDefaultsFillsEverySectionAndKeepsSetValues) {
  v1::ConfigFile file;
  ASSERT_THAT(
      Parse("publisher:\n  listen: \"127.0.0.1:1\"\n  transport: {frame_bytes: 65536}\n", &file),
      IsOk());
  ASSERT_THAT(ApplyDefaults(file.mutable_publisher()), IsOk());
  const v1::PublisherConfig& p = file.publisher();
  EXPECT_EQ(p.transport().frame_bytes(), 65536u);             // kept
  EXPECT_EQ(p.transport().max_streams_per_subscriber(), 8u);  // default
  EXPECT_EQ(p.log_level(), v1::LOG_LEVEL_INFO);
  EXPECT_TRUE(p.has_history());
  EXPECT_EQ(p.history().memory_budget_bytes(), 4294967296u);
  EXPECT_TRUE(p.baseline().fsync());
  EXPECT_EQ(p.codec().device(), v1::DEVICE_CPU);
  EXPECT_FALSE(p.codec().has_cuda_device());  // no default: unset means "not configured"
  EXPECT_TRUE(p.tls().has_insecure());
  EXPECT_FALSE(p.tls().insecure());
}

// Every field of the config schema: defaults parse and respect their own bounds, every singular
// scalar has presence, and is either defaulted, required, or deliberately optional.
void CheckSchema(const Descriptor* d) {
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const v1::FieldRules& rules = f->options().GetExtension(v1::rules);
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      CheckSchema(f->message_type());
      continue;
    }
    if (f->is_repeated()) {
      EXPECT_FALSE(rules.has_default_value()) << f->full_name();
      continue;
    }
    EXPECT_TRUE(f->has_presence()) << f->full_name() << " should be `optional`";
    const bool deliberately_unset = f->name() == "cuda_device" || f->name() == "cuda_device_uuid";
    EXPECT_TRUE(rules.has_default_value() || rules.required() || deliberately_unset)
        << f->full_name() << " has neither a default nor required";
  }
}

TEST(YamlProtoTest, ConfigSchemaIsConsistent) {
  CheckSchema(v1::ConfigFile::descriptor());
  v1::ConfigFile all;
  ASSERT_THAT(ApplyDefaults(&all), IsOk());  // every default parses within its bounds
  EXPECT_TRUE(all.has_publisher());
  EXPECT_TRUE(all.subscriber().upstream().backoff().has_multiplier());
}

TEST(YamlProtoTest, ApplyDefaultsRejectsDefaultsWithoutPresence) {
  // DataFrame has no rules at all: defaults are a no-op.
  v1::DataFrame frame;
  EXPECT_THAT(ApplyDefaults(&frame), IsOk());
}

TEST(YamlProtoTest, MessageToYamlRoundTrips) {
  v1::ConfigFile file;
  ASSERT_THAT(ApplyDefaults(file.mutable_subscriber()), IsOk());
  v1::SubscriberConfig& s = *file.mutable_subscriber();
  s.set_name("we\"ird\\name\n\ttab \x01 \xc3\xa9 # not a comment");
  s.mutable_upstream()->add_addresses("127.0.0.1:1");
  s.mutable_upstream()->add_addresses("[::1]:2");
  s.mutable_upstream()->mutable_backoff()->set_multiplier(1.1);
  s.mutable_upstream()->mutable_backoff()->set_jitter(1.0 / 3.0);
  s.mutable_staging()->set_max_bytes(UINT64_MAX);
  s.set_log_level(v1::LOG_LEVEL_CRITICAL);
  const std::string yaml = MessageToYaml(file);
  v1::ConfigFile back;
  absl::Status st = Parse(yaml, &back);
  ASSERT_THAT(st, IsOk()) << st << "\n" << yaml;
  EXPECT_TRUE(MessageDifferencer::Equals(file, back)) << yaml;

  v1::VersionHeader h;
  h.set_version(3);
  h.add_tensors()->mutable_spec()->set_name("a");
  h.add_tensors()->add_steps()->set_target_version(9);
  v1::VersionHeader h2;
  ASSERT_THAT(Parse(MessageToYaml(h), &h2), IsOk()) << MessageToYaml(h);
  EXPECT_TRUE(MessageDifferencer::Equals(h, h2)) << MessageToYaml(h);
}

TEST(YamlProtoTest, SourceMapRecordsLocations) {
  v1::ConfigFile file;
  SourceMap map("f.yaml");
  ASSERT_THAT(ParseYamlInto("publisher:\n  listen: \"127.0.0.1:1\"\n  tls:\n    insecure: true\n",
                            &file, &map),
              IsOk());
  ASSERT_NE(map.Find("publisher.listen"), nullptr);
  EXPECT_EQ(map.Find("publisher.listen")->line, 2);
  EXPECT_EQ(map.Find("publisher.listen")->column, 11);
  EXPECT_EQ(map.Prefix("publisher.tls.insecure"), "f.yaml:4:15: ");
  // Absent fields point at the nearest enclosing key present.
  EXPECT_EQ(map.Prefix("publisher.tls.cert"), map.Prefix("publisher.tls"));
  EXPECT_EQ(map.Prefix("publisher.name"), "f.yaml:2:3: ");  // the publisher mapping
  EXPECT_EQ(map.Prefix("subscriber.name"), "f.yaml: ");
}

}  // namespace
}  // namespace refit::config

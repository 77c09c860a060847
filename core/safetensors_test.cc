// safetensors: a byte-exact tiny file, files as other writers lay them out,
// round trips of every dtype and odd shape, and one test per corruption,
// each checking the error names the file and the problem.
#include "core/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/ops.h"

namespace ember {
namespace {

using ::testing::HasSubstr;

std::string tmp_path(const std::string& name) {
  const char* d = std::getenv("TEST_TMPDIR");
  return std::string(d ? d : "/tmp") + "/" + name;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file as any writer could produce it: header JSON (padded to 8 with
// spaces, as the reference writer does) and the data section.
std::string make_file(const std::string& header, const std::string& data) {
  std::string h = header;
  h.append((8 - h.size() % 8) % 8, ' ');
  return le64(h.size()) + h + data;
}

// Writes `bytes` to a file named after the test and loads it, so the error
// must name that file.
absl::StatusOr<SafetensorsFile> load_bytes(const std::string& name, const std::string& bytes) {
  const std::string path = tmp_path(name + ".safetensors");
  write_bytes(path, bytes);
  return load_safetensors(path);
}

std::string tensor_bytes(const Tensor& t) {
  Tensor c = t.cpu().contiguous();
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

// Two tensors and metadata, every byte computed by hand from the spec:
// N = 138 bytes of JSON + 6 spaces = 144 = 0x90, then 1.0f, 2.0f, int64 7.
TEST(Safetensors, ByteExactTinyFile) {
  const std::string json =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I64","shape":[],"data_offsets":[8,16]}})";
  ASSERT_EQ(json.size(), 138u);
  const std::string expected = std::string("\x90\0\0\0\0\0\0\0", 8) + json + "      " +
                               std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8) +
                               std::string("\x07\0\0\0\0\0\0\0", 8);
  ASSERT_EQ(expected.size(), 168u);

  Tensor a = Tensor::from_vector({1.0, 2.0}, {2});
  Tensor b = Tensor::from_vector({7.0}, {}, DType::Int64);
  auto bytes = serialize_safetensors({{"a", a}, {"b", b}}, {{"format", "pt"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, expected);

  const std::string path = tmp_path("tiny.safetensors");
  ASSERT_TRUE(save_safetensors(path, {{"a", a}, {"b", b}}, {{"format", "pt"}}).ok());
  EXPECT_EQ(read_bytes(path), expected);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  auto f = load_safetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), 2u);
  EXPECT_EQ(f->tensors[0].first, "a");
  EXPECT_EQ(f->tensors[1].first, "b");
  EXPECT_EQ(f->tensors[0].second.to_vector(), (std::vector<double>{1.0, 2.0}));
  EXPECT_EQ(f->tensors[1].second.dim(), 0);
  EXPECT_EQ(f->tensors[1].second.dtype(), DType::Int64);
  EXPECT_EQ(f->tensors[1].second.item(), 7.0);
  EXPECT_EQ(f->metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
}

// What the reference (Rust) writer emits for
//   save_file({"x": torch.tensor([[1., -2.], [0.5, 65504.]], dtype=torch.float16)}, f, {"format": "pt"})
// written out by hand, and a header the way another writer might lay it out:
// pretty-printed, keys in another order, tensors listed out of data order.
TEST(Safetensors, ReadsFilesOfOtherWriters) {
  const std::string ref = make_file(
      R"({"__metadata__":{"format":"pt"},"x":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})",
      std::string("\x00\x3c\x00\xc0\x00\x38\xff\x7b", 8));
  auto f = parse_safetensors(ref, "ref");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), 1u);
  EXPECT_EQ(f->tensors[0].second.dtype(), DType::Float16);
  EXPECT_EQ(f->tensors[0].second.sizes(), (Shape{2, 2}));
  EXPECT_EQ(f->tensors[0].second.to_vector(), (std::vector<double>{1.0, -2.0, 0.5, 65504.0}));
  // And ember writes the very same bytes.
  auto mine = serialize_safetensors({{"x", f->tensors[0].second}}, {{"format", "pt"}});
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(*mine, ref);

  const std::string pretty = make_file(R"({
    "second": {"shape": [1], "data_offsets": [4, 6], "dtype": "BF16"},
    "first":  {"data_offsets": [0, 4], "dtype": "I32", "shape": [1]},
    "__metadata__": {"note": "h\u00e9llo"}
  })",
                                       std::string("\x2a\x00\x00\x00\x80\x3f", 6));
  auto g = parse_safetensors(pretty, "pretty");
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->tensors.size(), 2u);
  EXPECT_EQ(g->tensors[0].first, "first");  // data order
  EXPECT_EQ(g->tensors[0].second.item(), 42.0);
  EXPECT_EQ(g->tensors[1].first, "second");
  EXPECT_EQ(g->tensors[1].second.item(), 1.0);
  EXPECT_EQ(g->metadata.at("note"), "h\xc3\xa9llo");
  EXPECT_NE(g->find("second"), nullptr);
  EXPECT_EQ(g->find("third"), nullptr);
}

TEST(Safetensors, RoundTripEveryDType) {
  const std::vector<DType> dtypes = {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64,
                                     DType::Int32,   DType::Int64,   DType::UInt8,    DType::Bool};
  const std::vector<std::string> names = {"F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL"};
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    EXPECT_EQ(safetensors_dtype_name(dtypes[i]), names[i]);
    std::vector<double> v = {0, 1, 2, 3, 100, 0};
    if (is_floating(dtypes[i])) v = {-1.5, 0.25, 3.0, -0.0, 1e-3, 7.75};
    if (dtypes[i] == DType::Bool) v = {1, 0, 1, 1, 0, 0};
    tensors.emplace_back("t_" + names[i], Tensor::from_vector(v, {2, 3}, dtypes[i]));
  }
  tensors.emplace_back("big_i64", Tensor::from_vector({-4e15, 12345}, {2}, DType::Int64));
  const std::string path = tmp_path("dtypes.safetensors");
  ASSERT_TRUE(save_safetensors(path, tensors).ok());
  auto f = load_safetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), tensors.size());
  EXPECT_TRUE(f->metadata.empty());
  for (size_t i = 0; i < tensors.size(); ++i) {
    SCOPED_TRACE(tensors[i].first);
    EXPECT_EQ(f->tensors[i].first, tensors[i].first);
    EXPECT_EQ(f->tensors[i].second.dtype(), tensors[i].second.dtype());
    EXPECT_EQ(f->tensors[i].second.sizes(), tensors[i].second.sizes());
    EXPECT_EQ(tensor_bytes(f->tensors[i].second), tensor_bytes(tensors[i].second));
  }
}

TEST(Safetensors, ZeroDimEmptyAndNonContiguous) {
  Tensor scalar = Tensor::from_vector({3.5}, {}, DType::Float64);
  Tensor empty = Tensor::empty({0}, DType::Float32);
  Tensor empty3 = Tensor::empty({2, 0, 3}, DType::Int32);
  Tensor m = arange(6).view({2, 3});
  Tensor mt = m.t();  // strides {1, 3}
  ASSERT_FALSE(mt.is_contiguous());
  auto bytes = serialize_safetensors({{"s", scalar}, {"e", empty}, {"e3", empty3}, {"mt", mt}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_THAT(*bytes, HasSubstr(R"("e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]})"));
  EXPECT_THAT(*bytes, HasSubstr(R"("e3":{"dtype":"I32","shape":[2,0,3],"data_offsets":[8,8]})"));
  auto f = parse_safetensors(*bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), 4u);
  EXPECT_EQ(f->tensors[0].first, "s");
  EXPECT_EQ(f->tensors[0].second.dim(), 0);
  EXPECT_EQ(f->tensors[0].second.item(), 3.5);
  EXPECT_EQ(f->tensors[1].first, "e");  // empty tensors at one offset keep header order
  EXPECT_EQ(f->tensors[1].second.sizes(), (Shape{0}));
  EXPECT_EQ(f->tensors[2].first, "e3");
  EXPECT_EQ(f->tensors[2].second.sizes(), (Shape{2, 0, 3}));
  EXPECT_EQ(f->tensors[3].second.sizes(), (Shape{3, 2}));
  EXPECT_EQ(f->tensors[3].second.to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  // No tensors at all: just "{}" padded.
  auto none = serialize_safetensors({});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, le64(8) + "{}      ");
  EXPECT_TRUE(parse_safetensors(*none)->tensors.empty());
}

TEST(Safetensors, CudaTensorsAreCopiedToCpu) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU";
  Tensor g = arange(4).cuda();
  auto f = parse_safetensors(*serialize_safetensors({{"g", g}}));
  ASSERT_TRUE(f.ok());
  EXPECT_FALSE(f->tensors[0].second.is_cuda());
  EXPECT_EQ(f->tensors[0].second.to_vector(), (std::vector<double>{0, 1, 2, 3}));
}

TEST(Safetensors, MetadataAndOverwrite) {
  const std::string path = tmp_path("meta.safetensors");
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"quote\"and\\", "line\nbreak"}, {"k", ""}};
  ASSERT_TRUE(save_safetensors(path, {{"w", arange(3)}}, meta).ok());
  ASSERT_TRUE(save_safetensors(path, {{"w2", arange(5)}}, meta).ok());  // replaces the file
  auto f = load_safetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata, meta);
  ASSERT_EQ(f->tensors.size(), 1u);
  EXPECT_EQ(f->tensors[0].first, "w2");
}

TEST(Safetensors, BoolBytesAreNormalized) {
  auto f = parse_safetensors(make_file(R"({"b":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
                                       std::string("\x00\x02\x01", 3)));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors[0].second.to_vector(), (std::vector<double>{0, 1, 1}));
}

TEST(Safetensors, SaveRejectsBadNames) {
  auto dup = serialize_safetensors({{"a", arange(2)}, {"a", arange(2)}});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.status().message(), HasSubstr("'a' appears twice"));
  EXPECT_FALSE(serialize_safetensors({{"__metadata__", arange(2)}}).ok());
  EXPECT_FALSE(serialize_safetensors({{"", arange(2)}}).ok());
  EXPECT_FALSE(serialize_safetensors({{"u", Tensor()}}).ok());
  EXPECT_FALSE(serialize_safetensors({{"\xff\xfe", arange(2)}}).ok());  // not UTF-8
  const std::string bad_dir = tmp_path("no/such/dir/x.safetensors");
  auto s = save_safetensors(bad_dir, {{"a", arange(2)}});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(bad_dir));
}

// ---- Corruption: every case is an error naming the file and the problem. ----

void expect_error(const absl::StatusOr<SafetensorsFile>& f, const std::string& file, const std::string& problem) {
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr(file));
  EXPECT_THAT(f.status().message(), HasSubstr(problem));
}

const std::string kF32x2 = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
const std::string kData8(8, '\x01');

TEST(SafetensorsCorrupt, MissingFile) {
  const std::string path = tmp_path("does_not_exist.safetensors");
  auto f = load_safetensors(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  expect_error(f, path, "No such file");
}

TEST(SafetensorsCorrupt, TooShortForHeaderLength) {
  expect_error(load_bytes("short", std::string("\x10\x00\x00", 3)), "short.safetensors", "truncated: 3 bytes");
  expect_error(load_bytes("zero", ""), "zero.safetensors", "truncated: 0 bytes");
}

TEST(SafetensorsCorrupt, HeaderLengthBeyondFileSize) {
  auto f = load_bytes("hlen", le64(1000) + "{}");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  expect_error(f, "hlen.safetensors", "header length 1000 exceeds the file size 10");
  // A huge length must not be allocated.
  expect_error(load_bytes("hlen2", le64(~0ull) + "{}      "), "hlen2.safetensors", "exceeds the file size");
}

TEST(SafetensorsCorrupt, TruncatedMidHeaderAndMidData) {
  const std::string good = make_file(kF32x2, kData8);
  ASSERT_TRUE(parse_safetensors(good).ok());
  expect_error(load_bytes("cut_header", good.substr(0, 30)), "cut_header.safetensors", "exceeds the file size");
  expect_error(load_bytes("cut_data", good.substr(0, good.size() - 3)), "cut_data.safetensors",
               "tensor 'w': data_offsets [0, 8] out of range: the data section has 5 bytes");
}

TEST(SafetensorsCorrupt, InvalidJson) {
  expect_error(load_bytes("badjson", make_file(R"({"w":{"dtype":"F32",)", "")), "badjson.safetensors",
               "invalid JSON header");
  expect_error(load_bytes("notobj", make_file("[1, 2]", "")), "notobj.safetensors", "not a JSON object");
  expect_error(load_bytes("badutf8", make_file("{\"\xff\":{}}", "")), "badutf8.safetensors", "invalid JSON header");
}

// Regression: a header of deeply nested JSON (here 200 KB of '[') overflowed
// the stack inside the JSON parser and crashed the process.
TEST(SafetensorsCorrupt, DeeplyNestedHeaderIsAnErrorNotACrash) {
  const std::string deep = "{\"w\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  expect_error(load_bytes("deep", make_file(deep, "")), "deep.safetensors", "nested deeper than 128 levels");
  expect_error(parse_safetensors(make_file(deep, ""), "in memory"), "in memory", "nested deeper than 128 levels");
  // Brackets inside strings are not nesting: a name full of them still loads.
  const std::string name(300, '[');
  const std::string ok = "{\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  auto f = parse_safetensors(make_file(ok, kData8));
  ASSERT_TRUE(f.ok()) << f.status();
}

TEST(SafetensorsCorrupt, HeaderOverTheFormatLimit) {
  // A sparse file: long enough for the declared header, which is never read.
  const std::string path = tmp_path("huge.safetensors");
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << le64(100'000'001); }
  std::filesystem::resize_file(path, 8 + 100'000'001);
  expect_error(load_safetensors(path), path, "exceeds the format's limit of 100000000");
  std::filesystem::remove(path);
}

TEST(SafetensorsCorrupt, BadEntries) {
  expect_error(load_bytes("nodtype", make_file(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", kData8)),
               "nodtype.safetensors", "tensor 'w': missing or non-string \"dtype\"");
  expect_error(load_bytes("noshape", make_file(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", kData8)),
               "noshape.safetensors", "tensor 'w': missing or non-array \"shape\"");
  expect_error(load_bytes("negshape", make_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", kData8)),
               "negshape.safetensors", "not a size");
  expect_error(load_bytes("badoffs", make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", kData8)),
               "badoffs.safetensors", "\"data_offsets\" must be [begin, end]");
  expect_error(load_bytes("entry", make_file(R"({"w":5})", "")), "entry.safetensors", "entry is not a JSON object");
  expect_error(load_bytes("meta", make_file(R"({"__metadata__":{"k":1}})", "")), "meta.safetensors",
               "__metadata__ entry 'k' is not a string");
  expect_error(load_bytes("overflow",
                          make_file(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                                    kData8)),
               "overflow.safetensors", "overflows");
}

TEST(SafetensorsCorrupt, UnknownDType) {
  auto f = load_bytes("dtype", make_file(R"({"w":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", kData8));
  expect_error(f, "dtype.safetensors", "tensor 'w': unknown dtype 'F99'");
  auto g = load_bytes("i8", make_file(R"({"w":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})", kData8));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented);
  expect_error(g, "i8.safetensors", "dtype I8 is valid safetensors but ember has no such dtype");
}

TEST(SafetensorsCorrupt, OffsetsOutOfRange) {
  expect_error(load_bytes("range", make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", kData8)),
               "range.safetensors", "data_offsets [0, 16] out of range: the data section has 8 bytes");
  expect_error(load_bytes("rev", make_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", kData8)),
               "rev.safetensors", "end before begin");
}

TEST(SafetensorsCorrupt, SizeNotMatchingShape) {
  expect_error(load_bytes("size", make_file(R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", kData8)),
               "size.safetensors", "tensor 'w': data_offsets [0, 8] hold 8 bytes, but shape [2] of F64 needs 16");
}

TEST(SafetensorsCorrupt, OverlapGapAndTrailingBytes) {
  expect_error(load_bytes("overlap", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                               kData8)),
               "overlap.safetensors", "tensor 'b': data_offsets [4, 8] overlap the previous tensor");
  expect_error(load_bytes("gap", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                           R"("b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})",
                                           kData8)),
               "gap.safetensors", "tensor 'b': data_offsets [6, 8] leave a gap (tensor 'a' ends at 4)");
  expect_error(load_bytes("lead", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", kData8)),
               "lead.safetensors", "leave a gap (the data section starts at 0)");
  expect_error(load_bytes("trailing", make_file(kF32x2, kData8 + "xyz")), "trailing.safetensors",
               "the tensors cover 8 bytes of the data section, which has 11 (trailing bytes)");
}

}  // namespace
}  // namespace ember

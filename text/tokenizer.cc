// Reading a tokenizer.json (with named errors), and encode/decode
// (text/tokenizer.h).
#include "text/tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/exception.h"
#include "text/byte_level.h"
#include "text/regex.h"

namespace ember::text {

using json = nlohmann::json;

struct Tokenizer::Impl {
  // One pre-tokenization step: a Split (isolated matches of a regex) or the
  // final ByteLevel.
  struct Step {
    std::unique_ptr<Regex> regex;  // Split's pattern, or GPT-2's for ByteLevel with use_regex
    bool byte_level = false;
    bool add_prefix_space = false;
  };

  std::string json_text;
  std::unique_ptr<BpeModel> model;
  std::vector<AddedToken> added;
  std::unique_ptr<AddedTokenMatcher> matcher;
  std::unordered_map<std::string, int32_t> added_ids;
  std::vector<Step> steps;
  std::vector<std::string> id_bytes;  // what decode() writes for each id
  std::vector<uint8_t> id_kind;       // 0: no such id, 1: a token, 2: a special token
  int64_t vocab_size = 0;

  void run(size_t step, std::string_view piece, std::vector<int32_t>& out) const {
    const Step& s = steps[step];
    if (!s.byte_level) {
      s.regex->split_isolated(piece, [&](size_t b, size_t e) { run(step + 1, piece.substr(b, e - b), out); });
      return;
    }
    // Hugging Face prepends the space to every piece that reaches
    // ByteLevel without one, not only to the text's start.
    std::string prefixed;
    if (s.add_prefix_space && piece[0] != ' ') {
      prefixed.reserve(piece.size() + 1);
      prefixed += ' ';
      prefixed += piece;
      piece = prefixed;
    }
    if (s.regex)
      s.regex->split_isolated(piece, [&](size_t b, size_t e) { model->tokenize(piece.substr(b, e - b), out); });
    else
      model->tokenize(piece, out);
  }
};

namespace {

// Errors name the document, the field and what is supported.
struct Reader {
  std::string origin;

  template <typename... Args>
  [[noreturn]] void fail(const std::string& field, const Args&... args) const {
    throw Error(detail::str_cat(origin, ": ", field, ": ", args...));
  }

  const json* member(const json& obj, const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }

  bool boolean(const json& obj, const char* key, const std::string& field, bool dflt) const {
    const json* v = member(obj, key);
    if (!v) return dflt;
    if (!v->is_boolean()) fail(field, "must be true or false, got ", v->dump());
    return v->get<bool>();
  }

  std::string type_of(const json& obj, const std::string& field, const std::string& supported) const {
    if (!obj.is_object()) fail(field, "must be an object; supported: ", supported);
    const json* t = member(obj, "type");
    if (!t || !t->is_string()) fail(field + ".type", "missing; supported: ", supported);
    return t->get<std::string>();
  }
};

constexpr const char* kPreTokenizers =
    "ByteLevel, or a Sequence of Split steps (behavior Isolated) ending in ByteLevel";

void read_pre_tokenizer(const Reader& r, const json& pt, const std::string& field,
                        std::vector<Tokenizer::Impl::Step>& steps) {
  const std::string type = r.type_of(pt, field, kPreTokenizers);
  if (type == "Sequence") {
    const json* list = r.member(pt, "pretokenizers");
    if (!list || !list->is_array()) r.fail(field + ".pretokenizers", "must be a list; supported: ", kPreTokenizers);
    for (size_t i = 0; i < list->size(); ++i)
      read_pre_tokenizer(r, (*list)[i], field + ".pretokenizers[" + std::to_string(i) + "]", steps);
    return;
  }
  if (!steps.empty() && steps.back().byte_level)
    r.fail(field, "'", type, "' after ByteLevel is not supported; supported: ", kPreTokenizers);
  Tokenizer::Impl::Step step;
  if (type == "ByteLevel") {
    step.byte_level = true;
    step.add_prefix_space = r.boolean(pt, "add_prefix_space", field + ".add_prefix_space", true);
    if (r.boolean(pt, "use_regex", field + ".use_regex", true)) step.regex = std::make_unique<Regex>(kGpt2Pattern);
  } else if (type == "Split") {
    const json* behavior = r.member(pt, "behavior");
    if (!behavior || *behavior != "Isolated")
      r.fail(field + ".behavior", behavior ? behavior->dump() : "missing", " is not supported; only \"Isolated\"");
    if (r.boolean(pt, "invert", field + ".invert", false))
      r.fail(field + ".invert", "true is not supported; only false");
    const json* pattern = r.member(pt, "pattern");
    if (pattern && pattern->is_object() && pattern->contains("Regex") && (*pattern)["Regex"].is_string()) {
      try {
        step.regex = std::make_unique<Regex>((*pattern)["Regex"].get<std::string>());
      } catch (const Error& e) {
        r.fail(field + ".pattern.Regex", e.what());
      }
    } else if (pattern && pattern->is_object() && pattern->contains("String") && (*pattern)["String"].is_string()) {
      // A literal: quoted for PCRE2 (\Q...\E cannot hold "\E" itself).
      std::string quoted;
      for (char c : (*pattern)["String"].get<std::string>()) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && !(static_cast<unsigned char>(c) & 0x80)) quoted += '\\';
        quoted += c;
      }
      if (quoted.empty()) r.fail(field + ".pattern.String", "an empty pattern is not supported");
      step.regex = std::make_unique<Regex>(quoted);
    } else {
      r.fail(field + ".pattern", "must be {\"Regex\": \"...\"} or {\"String\": \"...\"}");
    }
  } else {
    r.fail(field + ".type", "'", type, "' is not supported; supported: ", kPreTokenizers);
  }
  steps.push_back(std::move(step));
}

std::unique_ptr<BpeModel> read_model(const Reader& r, const json& m) {
  const std::string type = r.type_of(m, "model", "BPE");
  if (type != "BPE") r.fail("model.type", "'", type, "' is not supported; only BPE is supported");
  if (const json* d = r.member(m, "dropout"); d && !(d->is_number() && d->get<double>() == 0))
    r.fail("model.dropout", d->dump(), " is not supported; only null (no dropout)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json* v = r.member(m, key);
    if (v && !(v->is_string() && v->get<std::string>().empty()))
      r.fail(std::string("model.") + key, v->dump(), " is not supported by byte-level BPE; only null");
  }
  const json* vocab_json = r.member(m, "vocab");
  if (!vocab_json || !vocab_json->is_object()) r.fail("model.vocab", "must be an object of token: id");
  std::unordered_map<std::string, int32_t> vocab;
  vocab.reserve(vocab_json->size());
  for (auto it = vocab_json->begin(); it != vocab_json->end(); ++it) {
    const json& v = it.value();
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
      r.fail("model.vocab", "token '", it.key(), "' has id ", v.dump(), "; ids are integers in [0, 2^31)");
    vocab.emplace(it.key(), v.get<int32_t>());
  }
  BpeOptions opt;
  if (const json* u = r.member(m, "unk_token")) {
    if (!u->is_string()) r.fail("model.unk_token", "must be a string or null");
    opt.unk_token = u->get<std::string>();
    if (!vocab.count(*opt.unk_token)) r.fail("model.unk_token", "'", *opt.unk_token, "' is not in model.vocab");
  }
  opt.fuse_unk = r.boolean(m, "fuse_unk", "model.fuse_unk", false);
  opt.byte_fallback = r.boolean(m, "byte_fallback", "model.byte_fallback", false);
  opt.ignore_merges = r.boolean(m, "ignore_merges", "model.ignore_merges", false);

  const json* merges_json = r.member(m, "merges");
  std::vector<std::pair<std::string, std::string>> merges;
  if (merges_json) {
    if (!merges_json->is_array()) r.fail("model.merges", "must be a list of \"a b\" strings or [a, b] pairs");
    merges.reserve(merges_json->size());
    for (size_t i = 0; i < merges_json->size(); ++i) {
      const json& e = (*merges_json)[i];
      const std::string field = "model.merges[" + std::to_string(i) + "]";
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          r.fail(field, "'", s, "' is not two tokens separated by one space");
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>(), b = e[1].get<std::string>();
      } else {
        r.fail(field, e.dump(), " is neither an \"a b\" string nor an [a, b] pair");
      }
      for (const std::string& t : {a, b, a + b})
        if (!vocab.count(t)) r.fail(field, "token '", t, "' is not in model.vocab (merge '", a, "' + '", b, "')");
      merges.emplace_back(std::move(a), std::move(b));
    }
  }
  return std::make_unique<BpeModel>(std::move(vocab), merges, std::move(opt));
}

std::vector<AddedToken> read_added_tokens(const Reader& r, const json& doc) {
  std::vector<AddedToken> out;
  const json* list = r.member(doc, "added_tokens");
  if (!list) return out;
  if (!list->is_array()) r.fail("added_tokens", "must be a list");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& t = (*list)[i];
    const std::string field = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) r.fail(field, "must be an object with id and content");
    AddedToken a;
    const json* id = r.member(t, "id");
    if (!id || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() > INT32_MAX)
      r.fail(field + ".id", "must be an integer in [0, 2^31)");
    const json* content = r.member(t, "content");
    if (!content || !content->is_string()) r.fail(field + ".content", "must be a string");
    a.id = id->get<int32_t>();
    a.content = content->get<std::string>();
    a.single_word = r.boolean(t, "single_word", field + ".single_word", false);
    a.lstrip = r.boolean(t, "lstrip", field + ".lstrip", false);
    a.rstrip = r.boolean(t, "rstrip", field + ".rstrip", false);
    a.special = r.boolean(t, "special", field + ".special", false);
    a.normalized = r.boolean(t, "normalized", field + ".normalized", !a.special);
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace

Tokenizer Tokenizer::from_json(std::string_view text, const std::string& origin) {
  Reader r{origin};
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(origin + ": not valid JSON: " + e.what());
  }
  if (!doc.is_object()) r.fail("(top level)", "must be an object (a Hugging Face tokenizer.json)");
  auto impl = std::make_shared<Impl>();
  impl->json_text = std::string(text);

  if (const json* n = r.member(doc, "normalizer"))
    r.fail("normalizer", "type ", n->is_object() && n->contains("type") ? (*n)["type"].dump() : n->dump(),
           " is not supported; only null (no normalizer)");
  const json* model = r.member(doc, "model");
  if (!model) r.fail("model", "missing; only BPE is supported");
  impl->model = read_model(r, *model);
  const json* pt = r.member(doc, "pre_tokenizer");
  if (!pt) r.fail("pre_tokenizer", "missing (null); supported: ", kPreTokenizers);
  read_pre_tokenizer(r, *pt, "pre_tokenizer", impl->steps);
  if (impl->steps.empty() || !impl->steps.back().byte_level)
    r.fail("pre_tokenizer", "does not end in ByteLevel; supported: ", kPreTokenizers);
  if (const json* d = r.member(doc, "decoder")) {
    const std::string type = r.type_of(*d, "decoder", "ByteLevel");
    if (type != "ByteLevel") r.fail("decoder.type", "'", type, "' is not supported; only ByteLevel (or null)");
  }
  impl->added = read_added_tokens(r, doc);
  impl->matcher = std::make_unique<AddedTokenMatcher>(impl->added);

  // The id -> bytes table of decode(): Hugging Face's ByteLevel decoder
  // maps a token's characters back to bytes when every one is a byte's
  // character, else keeps the token's UTF-8 as is; added tokens by content.
  impl->vocab_size = impl->model->id_bound();
  for (const AddedToken& a : impl->added) impl->vocab_size = std::max<int64_t>(impl->vocab_size, int64_t{a.id} + 1);
  impl->id_bytes.assign(impl->vocab_size, {});
  impl->id_kind.assign(impl->vocab_size, 0);
  auto decoded = [](const std::string& token) {
    auto bytes = token_to_bytes(token);
    return bytes ? std::move(*bytes) : token;
  };
  for (const auto& [token, id] : impl->model->vocab()) {
    impl->id_bytes[id] = decoded(token);
    impl->id_kind[id] = 1;
  }
  for (const AddedToken& a : impl->added) {
    impl->id_bytes[a.id] = decoded(a.content);
    impl->id_kind[a.id] = a.special ? 2 : 1;
    impl->added_ids[a.content] = a.id;
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EMBER_CHECK(in, path, ": cannot open the tokenizer file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path);
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  const size_t bad = find_invalid_utf8(text);
  EMBER_CHECK(bad == std::string_view::npos, "encode: the text is not valid UTF-8 at byte ", bad);
  out.reserve(out.size() + text.size() / 3);
  const Impl& im = *impl_;
  if (im.matcher->empty()) {
    if (!text.empty()) im.run(0, text, out);
    return;
  }
  im.matcher->split(
      text, [&](size_t b, size_t e) { im.run(0, text.substr(b, e - b), out); }, [&](int32_t id) { out.push_back(id); });
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode(text, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    EMBER_CHECK(id >= 0 && id < im.vocab_size && im.id_kind[id] != 0, "decode: ids[", i, "] = ", id,
                " is not in the vocabulary (", im.vocab_size, " ids)");
    if (skip_special_tokens && im.id_kind[id] == 2) continue;
    out += im.id_bytes[id];
  }
  return out;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->added_ids.find(std::string(token));
  if (it != impl_->added_ids.end()) return it->second;
  return impl_->model->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  for (const AddedToken& a : impl_->added)
    if (a.id == id) return a.content;
  for (const auto& [token, i] : impl_->model->vocab())
    if (i == id) return token;
  return std::nullopt;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const BpeModel& Tokenizer::model() const { return *impl_->model; }
const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
const std::string& Tokenizer::to_json() const { return impl_->json_text; }

void Tokenizer::save(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    EMBER_CHECK(out, path, ": cannot write the tokenizer file (", tmp, ")");
    out << impl_->json_text;
    out.close();
    EMBER_CHECK(out, path, ": writing the tokenizer file failed");
  }
  EMBER_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, path, ": cannot rename ", tmp, " to it");
}

}  // namespace ember::text

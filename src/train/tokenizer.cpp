// tokenizer.cpp: see tokenizer.h. SentencePiece stays inside this file: nothing else includes its
// headers, so the rest of strata does not depend on them.
#include "train/tokenizer.h"

#include "core/bytes.h"
#include "core/error.h"
#include "core/system.h"
#include "model/file_io.h"
#include "model/tokens.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace strata {

namespace {

constexpr uint32_t kByteEos = 256;

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<uint32_t> encode(std::string_view text) const override {
    std::vector<uint32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(std::span<const uint32_t> ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == kByteEos) continue;
      if (ids[i] > kByteEos)
        fail(
            "byte tokenizer: id {} at position {} is outside its vocabulary of 257 (bytes 0..255, "
            "end-of-text 256); the ids come from another tokenizer",
            ids[i], i);
      text.push_back(static_cast<char>(ids[i]));
    }
    return text;
  }
  int64_t vocab_size() const override { return 257; }
  std::optional<uint32_t> eos_id() const override { return kByteEos; }
  std::string name() const override { return "byte"; }
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& model) : path_(model.string()) {
    const sentencepiece::util::Status status = sp_.Load(path_);
    if (!status.ok())
      fail(
          "SentencePiece model {}: cannot load it: {}; pass the path of a SentencePiece .model "
          "file (or --tokenizer byte)",
          path_, status.ToString());
    if (sp_.GetPieceSize() < 1)
      fail("SentencePiece model {}: it has no pieces; the file is damaged", path_);
  }
  std::vector<uint32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const sentencepiece::util::Status status = sp_.Encode(text, &ids);
    if (!status.ok())
      fail("SentencePiece model {}: encoding {} bytes of text failed: {}", path_, text.size(),
           status.ToString());
    return std::vector<uint32_t>(ids.begin(), ids.end());
  }
  std::string decode(std::span<const uint32_t> ids) const override {
    std::vector<int> v(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= static_cast<uint32_t>(sp_.GetPieceSize()))
        fail("SentencePiece model {}: id {} at position {} is outside its vocabulary of {}", path_,
             ids[i], i, sp_.GetPieceSize());
      v[i] = static_cast<int>(ids[i]);
    }
    std::string text;
    const sentencepiece::util::Status status = sp_.Decode(v, &text);
    if (!status.ok())
      fail("SentencePiece model {}: decoding {} ids failed: {}", path_, ids.size(),
           status.ToString());
    return text;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<uint32_t> eos_id() const override {
    const int id = sp_.eos_id();
    if (id < 0) return std::nullopt;
    return static_cast<uint32_t>(id);
  }
  // Its <s> before each text, as Hugging Face's LlamaTokenizer (add_bos_token) and the same
  // model's tokenizer.json put it; none for a model trained without one.
  std::vector<uint32_t> prefix_ids() const override {
    const int id = sp_.bos_id();
    if (id < 0) return {};
    return {static_cast<uint32_t>(id)};
  }
  std::string name() const override { return path_; }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

// A line without its '\n' and any '\r' before it.
std::string_view strip_eol(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

void each_jsonl(std::string_view text, std::string_view source, const DocumentFn& fn,
                const ConsumedFn& consumed) {
  size_t start = 0;
  for (int64_t line_no = 1; start < text.size(); ++line_no) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = strip_eol(text.substr(start, end - start));
    start = end + 1;
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(
          "{} line {}: not valid JSON ({}); each line of a .jsonl file must be one JSON object "
          "with a \"text\" string",
          source, line_no, e.what());
    }
    const auto string_at = [&](const char* key) {
      return j.is_object() && j.contains(key) && j[key].is_string();
    };
    Document doc;
    if (string_at("text") && !j.contains("prompt") && !j.contains("completion")) {
      doc.text = j["text"].get<std::string>();
    } else if (string_at("prompt") && string_at("completion") && !j.contains("text")) {
      doc.prompt = j["prompt"].get<std::string>();
      doc.text = j["completion"].get<std::string>();
    } else if (j.is_object() && j.contains("messages")) {
      fail(
          "{} line {}: a \"messages\" row (a conversation) needs the model's chat template, "
          "which strata does not run; render each conversation into a \"prompt\" (the turns "
          "before the last assistant turn, with the template's markers) and a \"completion\" "
          "(that turn), e.g. with the tokenizer's apply_chat_template",
          source, line_no);
    } else {
      fail(
          "{} line {}: {}; each line of a .jsonl file must be one JSON object with a \"text\" "
          "string, or with a \"prompt\" and a \"completion\" string (only the completion is "
          "trained on)",
          source, line_no,
          j.is_object() && j.contains("text") && (j.contains("prompt") || j.contains("completion"))
              ? "both \"text\" and a prompt or completion"
              : fmt::format("no \"text\" string, nor a \"prompt\" and a \"completion\" string, "
                            "in {}",
                            line.size() > 80 ? std::string(line.substr(0, 77)) + "..." : line));
    }
    if (!doc.text.empty() || !doc.prompt.empty()) fn(std::move(doc));
    if (consumed) consumed(std::min(start, text.size()));
  }
}

void each_text(std::string_view text, const DocumentFn& fn, const ConsumedFn& consumed) {
  std::string doc;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    const size_t next = end == std::string_view::npos ? text.size() : end + 1;
    if (end == std::string_view::npos) end = text.size();
    if (strip_eol(text.substr(start, end - start)) == "%") {
      if (!doc.empty()) fn(Document{{}, std::move(doc)});
      doc.clear();
      if (consumed) consumed(next);
    } else {
      doc.append(text.substr(start, next - start));  // the line with its newline
    }
    start = next;
  }
  if (!doc.empty()) fn(Document{{}, std::move(doc)});
}

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() {
  return std::make_unique<ByteTokenizer>();
}

std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::filesystem::path& model) {
  return std::make_unique<SentencePieceTokenizer>(model);
}

std::optional<std::filesystem::path> model_tokenizer_file(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const char* name : {"tokenizer.json", "tokenizer.model"})
    if (std::filesystem::is_regular_file(dir / name, ec)) return dir / name;
  return std::nullopt;
}

std::unique_ptr<Tokenizer> open_tokenizer(std::string_view spec) {
  namespace fs = std::filesystem;
  if (spec == "byte") return make_byte_tokenizer();
  if (spec.empty())
    fail(
        "tokenizer: none given; pass --tokenizer byte, a Hugging Face tokenizer.json (or its "
        "model directory) or a SentencePiece .model");
  const fs::path path(spec);
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (const std::optional<fs::path> file = model_tokenizer_file(path))
      return open_tokenizer(file->string());
    fail(
        "tokenizer {}: the directory has neither tokenizer.json nor tokenizer.model; pass the "
        "directory of a Hugging Face model that ships one, or the tokenizer file itself",
        path.string());
  }
  if (path.extension() == ".json") return load_hf_tokenizer(path);
  return load_sentencepiece_tokenizer(path);
}

DocumentFormat document_format_of(const std::filesystem::path& path) {
  return path.extension() == ".jsonl" ? DocumentFormat::jsonl : DocumentFormat::text;
}

void for_each_document(std::string_view text, DocumentFormat format, std::string_view source,
                       const DocumentFn& fn, const ConsumedFn& consumed) {
  if (format == DocumentFormat::jsonl)
    each_jsonl(text, source, fn, consumed);
  else
    each_text(text, fn, consumed);
}

std::vector<Document> split_documents(std::string_view text, DocumentFormat format,
                                      std::string_view source) {
  std::vector<Document> docs;
  for_each_document(text, format, source, [&](Document d) { docs.push_back(std::move(d)); });
  return docs;
}

void read_documents(const std::filesystem::path& path, const DocumentFn& fn) {
  const MappedFile file = MappedFile::open(path, "input text");
  const std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
  file.advise_sequential(0, file.size());
  // The pages read are handed back every 64 MiB, so a large input does not stay resident.
  constexpr uint64_t kRelease = 64ull << 20;
  uint64_t released = 0;
  for_each_document(text, document_format_of(path), file.path(), fn, [&](uint64_t at) {
    const uint64_t upto = at / kRelease * kRelease;
    if (upto > released) {
      file.release(released, upto - released);
      released = upto;
    }
  });
}

std::vector<Document> read_documents(const std::filesystem::path& path) {
  std::vector<Document> docs;
  read_documents(path, [&](Document d) { docs.push_back(std::move(d)); });
  return docs;
}

std::vector<uint32_t> tokenize_documents(const Tokenizer& tokenizer,
                                         const std::vector<std::string>& documents, bool append_eos,
                                         bool after_others) {
  std::vector<Document> docs(documents.size());
  for (size_t d = 0; d < documents.size(); ++d) docs[d].text = documents[d];
  return encode_documents(tokenizer, docs, append_eos, after_others).tokens;
}

TokenStream encode_documents(const Tokenizer& tokenizer, const std::vector<Document>& documents,
                             bool append_eos, bool after_others) {
  const std::optional<uint32_t> eos = tokenizer.eos_id();
  const std::vector<uint32_t> prefix = tokenizer.prefix_ids(), suffix = tokenizer.suffix_ids();
  const bool suffix_ends = eos.has_value() && !suffix.empty() && suffix.back() == *eos;
  if (!eos.has_value() && !documents.empty() &&
      (documents.size() > 1 || append_eos || after_others))
    fail(
        "tokenizer {}: it has no end-of-text piece to write between documents; use a model "
        "trained with an eos piece, or one document without --append-eos",
        tokenizer.name());
  // Documents are encoded on every core (each tokenizer's encode is const and keeps its state
  // per call), then joined in order: the same stream as one at a time. A prompt is encoded
  // apart from its completion, so the boundary between them is exact.
  std::vector<std::vector<uint32_t>> prompts(documents.size()), texts(documents.size());
  tbb::parallel_for(tbb::blocked_range<size_t>(0, documents.size()), [&](const auto& range) {
    for (size_t d = range.begin(); d < range.end(); ++d) {
      if (!documents[d].prompt.empty()) prompts[d] = tokenizer.encode(documents[d].prompt);
      texts[d] = tokenizer.encode(documents[d].text);
    }
  });
  size_t total = 0;
  for (size_t d = 0; d < documents.size(); ++d)
    total += prompts[d].size() + texts[d].size() + prefix.size() + suffix.size() + 1;
  TokenStream out;
  out.tokens.reserve(total);
  out.counts.reserve(total);
  const auto put = [&](const std::vector<uint32_t>& ids, uint8_t counts) {
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.counts.insert(out.counts.end(), ids.size(), counts);
  };
  for (size_t d = 0; d < documents.size(); ++d) {
    // End-of-text ends the document before (a completion's end counts: the model learns to stop).
    if ((d > 0 || after_others) && !suffix_ends) put({*eos}, 1);
    const bool prompted = !documents[d].prompt.empty();
    out.prompted = out.prompted || prompted;
    put(prefix, prompted ? 0 : 1);
    put(prompts[d], 0);
    put(texts[d], 1);
    std::vector<uint32_t>().swap(prompts[d]);
    std::vector<uint32_t>().swap(texts[d]);
    put(suffix, 1);
  }
  if (append_eos && !documents.empty() && !suffix_ends) put({*eos}, 1);
  return out;
}

TokenizedFiles tokenize_files(const Tokenizer& tokenizer,
                              const std::vector<std::filesystem::path>& inputs,
                              const std::filesystem::path& output, const TokenizeOptions& options) {
  const uint64_t shard_tokens = options.shard_tokens, batch_bytes = options.batch_bytes;
  const bool append_eos = options.append_eos;
  const std::string& response = options.response_template;
  // Every input opens before anything is written: a missing second file leaves no shards.
  for (const std::filesystem::path& input : inputs) (void)MappedFile::open(input, "input text");
  const uint64_t memory = options.memory_bytes > 0 ? options.memory_bytes : memory_info().available;
  TokenizedFiles r;
  r.width = tokenizer.vocab_size() > 65536 ? TokenWidth::u32 : TokenWidth::u16;
  LlmcTokenWriter writer(output, r.width, shard_tokens);
  // Masks start with the first prompted document: the tokens before it all count.
  std::unique_ptr<LossMaskWriter> masks;
  // Documents are held a batch at a time: read in order, encoded in parallel, written in order.
  // A full batch is written when the next document arrives, so the last batch is known to be
  // the last (--append-eos).
  std::vector<Document> batch;
  uint64_t held = 0, written = 0;
  auto flush = [&](bool last) {
    const TokenStream stream = encode_documents(tokenizer, batch, last && append_eos, written > 0);
    if (stream.prompted && !masks) {
      masks = std::make_unique<LossMaskWriter>(output, shard_tokens);
      masks->write_ones(writer.tokens());
    }
    writer.write(stream.tokens);  // before its flags: a mask shard closes on complete tokens
    if (masks) masks->write(stream.counts);
    for (uint8_t c : stream.counts) r.counted += c;
    written += batch.size();
    batch.clear();
    held = 0;
  };
  for (const std::filesystem::path& input : inputs) {
    uint64_t in_file = 0;
    read_documents(input, [&](Document doc) {
      ++in_file;
      if (!response.empty() && doc.prompt.empty()) {
        const size_t at = doc.text.find(response);
        if (at == std::string::npos) {
          ++r.untemplated;
          return;
        }
        doc.prompt = doc.text.substr(0, at + response.size());
        doc.text.erase(0, at + response.size());
      }
      if (held >= batch_bytes) flush(false);
      const uint64_t bytes = doc.prompt.size() + doc.text.size();
      if (memory > 0 && bytes > memory / kDocumentBytesPerByte)
        fail(
            "tokenize: document {} of {} is {}; a document is encoded whole, about {} bytes of "
            "memory a byte ({}), more than the {} available; cut it into documents: lines "
            "holding only % separate the documents of a .txt, and a .jsonl holds one per line",
            in_file, input.string(), format_bytes(bytes), kDocumentBytesPerByte,
            format_bytes(bytes * kDocumentBytesPerByte), format_bytes(memory));
      r.bytes += bytes;
      held += bytes;
      ++r.documents;
      r.prompted += doc.prompt.empty() ? 0 : 1;
      batch.push_back(std::move(doc));
    });
  }
  if (r.documents == 0) {
    std::vector<std::string> names;
    for (const std::filesystem::path& p : inputs) names.push_back(p.string());
    if (r.untemplated > 0)
      fail(
          "tokenize: none of the {} documents in {} holds the response template {}; check "
          "--response-template against the data (it is matched exactly, spaces and newlines "
          "included)",
          r.untemplated, fmt::join(names, ", "), nlohmann::json(response).dump());
    fail("tokenize: no document in {}; the input is empty (or every .jsonl \"text\" is empty)",
         fmt::join(names, ", "));
  }
  flush(true);
  r.tokens = writer.tokens();
  r.files = writer.finish();
  if (masks) {
    r.masks = masks->finish();
  } else {
    // A mask from an earlier run beside a file just rewritten would not match it (LossMask
    // refuses it): it goes.
    for (const std::filesystem::path& f : r.files) {
      std::error_code ec;
      if (std::filesystem::remove(loss_mask_path(f), ec)) r.removed.push_back(loss_mask_path(f));
    }
  }
  return r;
}

}  // namespace strata

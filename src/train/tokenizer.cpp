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

#include <optional>
#include <string_view>
#include <utility>

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
  std::optional<std::string> special_piece(uint32_t id) const override {
    if (id == kByteEos) return "<eos>";
    return std::nullopt;
  }
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
  std::optional<std::string> special_piece(uint32_t id) const override {
    const int i = static_cast<int>(id);
    if (id >= static_cast<uint32_t>(sp_.GetPieceSize()) || !sp_.IsControl(i)) return std::nullopt;
    return sp_.IdToPiece(i);
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

// A line without its '\n' and any '\r' before it.
std::string_view strip_eol(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

using ojson = nlohmann::ordered_json;

// ShareGPT's turns ({"from": "human" | "gpt" | "system" | ..., "value": text}) as messages with
// the roles chat templates know, as axolotl and LLaMA-Factory map them.
ojson sharegpt_messages(const ojson& turns, std::string_view source, int64_t line_no) {
  static const std::pair<const char*, const char*> kRoles[] = {{"human", "user"},
                                                               {"user", "user"},
                                                               {"gpt", "assistant"},
                                                               {"assistant", "assistant"},
                                                               {"model", "assistant"},
                                                               {"chatgpt", "assistant"},
                                                               {"system", "system"},
                                                               {"tool", "tool"},
                                                               {"function", "tool"},
                                                               {"observation", "tool"},
                                                               {"function_response", "tool"}};
  if (!turns.is_array() || turns.empty())
    fail(
        "{} line {}: \"conversations\" is {}, not a list of turns; ShareGPT's turns are objects "
        "with a \"from\" (human, gpt, system, ...) and a \"value\"",
        source, line_no, turns.is_array() ? "an empty list" : turns.type_name());
  ojson messages = ojson::array();
  for (size_t k = 0; k < turns.size(); ++k) {
    const ojson& t = turns[k];
    if (!t.is_object() || !t.contains("from") || !t["from"].is_string() || !t.contains("value") ||
        !t["value"].is_string())
      fail(
          "{} line {}: turn {} of \"conversations\" is not an object with a \"from\" and a "
          "\"value\" string; fix the row, or give it as \"messages\" of a \"role\" and a "
          "\"content\"",
          source, line_no, k);
    const std::string from = t["from"].get<std::string>();
    const auto* role = std::find_if(std::begin(kRoles), std::end(kRoles),
                                    [&](const auto& r) { return from == r.first; });
    if (role == std::end(kRoles))
      fail(
          "{} line {}: turn {} of \"conversations\" is from {}, which strata cannot map to a "
          "role (it knows human, user, gpt, assistant, model, chatgpt, system, tool, function, "
          "observation); give the row as \"messages\" with the roles the template expects",
          source, line_no, k, ojson(from).dump());
    messages.push_back({{"role", role->second}, {"content", t["value"]}});
  }
  return messages;
}

// Messages as apply_chat_template takes them: a non-empty list of objects with a "role" string.
void check_messages(const ojson& messages, std::string_view what, std::string_view source,
                    int64_t line_no) {
  if (!messages.is_array() || messages.empty())
    fail(
        "{} line {}: {} is {}, not a list of messages; each message is an object with a "
        "\"role\" and a \"content\"",
        source, line_no, what, messages.is_array() ? "an empty list" : messages.type_name());
  for (size_t k = 0; k < messages.size(); ++k) {
    const ojson& m = messages[k];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      fail(
          "{} line {}: message {} of {} has no \"role\" string; each message is an object with "
          "a \"role\" (system, user, assistant, ...) and a \"content\"",
          source, line_no, k, what);
  }
}

// Where a template failed on a special token it was not given (a template file passed without
// the tokenizer_config.json that names its tokens), what to do about it.
std::string missing_token_hint(const ChatFormat& format, std::string_view message) {
  for (const char* key : kSpecialTokenKeys)
    if (message.find(fmt::format("'{}' is undefined", key)) != std::string_view::npos &&
        !format.tokens.contains(key))
      return fmt::format(
          "; the template prints {}, which transformers takes from the tokenizer's "
          "tokenizer_config.json: pass --tokenizer with the model's directory (or a "
          "tokenizer_config.json as --chat-template)",
          key);
  return "";
}

// A conversation row rendered: the whole as the template writes it and, unless every token
// counts, the byte ranges of its replies: what the template's {% generation %} blocks wrote,
// where it has them; otherwise each assistant message (or a prompt/completion row's completion)
// found by rendering the turns before it (with the generation prompt) and through it, which must
// both begin the whole. Where they do not (a template that writes a turn differently once others
// follow: Qwen3 drops the empty <think></think> of every reply but the last), an assistant
// message is found by its content instead, as axolotl finds a turn: the whole conversation
// rendered again with that content swapped for a marker differs from the first rendering only
// where the content is; the reply is that content and the text that ends the turn (what follows
// the content when it is the last turn, e.g. "<|im_end|>\n"), which must follow it in the whole.
Document render_conversation(const ChatOptions& chat, const Conversation& c) {
  const ojson& messages = c.messages;
  const ojson& tools = c.tools;
  const ojson& kwargs = c.template_kwargs;
  const size_t prompt_messages = c.prompt_messages;
  const std::string_view source = c.source;
  const int64_t line_no = c.line;
  const ChatFormat& format = *chat.format;
  const auto render = [&](size_t count, bool generation_prompt) {
    ojson part = ojson::array();
    for (size_t k = 0; k < count; ++k) part.push_back(messages[k]);
    try {
      return format.render(part, tools, generation_prompt, nullptr, kwargs);
    } catch (const Error& e) {
      fail("{} line {}: {}{}", source, line_no, e.what(), missing_token_hint(format, e.what()));
    }
  };
  Document doc;
  doc.rendered = true;
  // A template with TRL's {% generation %} markers says which text is the assistant's: the
  // replies are what its blocks wrote (as TRL's assistant_only_loss takes them) in one rendering.
  const bool marked =
      prompt_messages == 0 && !chat.all_tokens && format.for_tools(tools).has_generation();
  try {
    doc.text = format.render(messages, tools, false, marked ? &doc.replies : nullptr, kwargs);
  } catch (const Error& e) {
    fail("{} line {}: {}{}", source, line_no, e.what(), missing_token_hint(format, e.what()));
  }
  // Every token counts with --chat-loss all, TRL's assistant_only_loss off; a conversational
  // prompt/completion row still trains on its completion alone (TRL's completion_only_loss,
  // which is apart from it).
  if (chat.all_tokens && prompt_messages == 0) return doc;
  if (marked) {
    if (doc.replies.empty())
      fail(
          "{} line {}: the chat template {} marks no text of this conversation as the "
          "assistant's ({{% generation %}} blocks), so with only the replies counted it would "
          "train on nothing; give it an assistant message, or train on every token with "
          "--chat-loss all",
          source, line_no, format.source);
    return doc;
  }
  // Where message k's content lies in the rendering of `count` messages with its content as
  // it is (`as_is`): [begin, end), or nullopt when swapping it for a marker changes anything
  // but one run of text (the template prints it twice, or not as given).
  const auto content_span =
      [&](size_t k, size_t count,
          const std::string& as_is) -> std::optional<std::pair<size_t, size_t>> {
    const std::string& content = messages[k]["content"].get_ref<const std::string&>();
    // Markers whose first and last letters differ from the content's, so that the text the
    // two renderings share stops exactly at the content's edges.
    for (const char* marker :
         {"QstrataReplyMarkerZ", "WstrataReplyMarkerX", "XstrataReplyMarkerW"}) {
      const std::string_view m = marker;
      if (as_is.find(m) != std::string::npos) continue;
      ojson part = ojson::array();
      for (size_t i = 0; i < count; ++i) part.push_back(messages[i]);
      part[k]["content"] = marker;
      std::string swapped;
      try {
        swapped = format.render(part, tools, false, nullptr, kwargs);
      } catch (const Error&) {
        return std::nullopt;
      }
      size_t p = 0;
      while (p < as_is.size() && p < swapped.size() && as_is[p] == swapped[p]) ++p;
      size_t q = 0;
      while (q < as_is.size() - p && q < swapped.size() - p &&
             as_is[as_is.size() - 1 - q] == swapped[swapped.size() - 1 - q])
        ++q;
      if (swapped.compare(p, swapped.size() - q - p, m) == 0 && as_is.size() - q > p &&
          !content.empty())
        return std::pair{p, as_is.size() - q};
    }
    return std::nullopt;
  };
  const auto reply = [&](size_t first, size_t end, const char* what) {
    const std::string before = render(first, true), through = render(end, false);
    const bool begins = doc.text.starts_with(before), ends = doc.text.starts_with(through);
    const bool one_message = end == first + 1 && prompt_messages == 0 &&
                             messages[first].contains("content") &&
                             messages[first]["content"].is_string();
    if ((!begins || !ends) && one_message) {
      // Found by its content: where it lies in the whole, and the end of its turn after it.
      const auto in_whole = content_span(first, messages.size(), doc.text);
      const auto in_turn = content_span(first, end, through);
      if (in_whole && in_turn) {
        const std::string_view closing = std::string_view(through).substr(in_turn->second);
        const size_t stop = in_whole->second + closing.size();
        const bool closed = doc.text.compare(in_whole->second, closing.size(), closing) == 0;
        const bool in_order = doc.replies.empty() || doc.replies.back().second <= in_whole->first;
        if (closed && in_order) {
          doc.replies.emplace_back(in_whole->first, stop);
          return;
        }
      }
    }
    if (!begins || !ends || through.size() < before.size())
      fail(
          "{} line {}: the chat template {} renders {} {} text that does not begin the whole "
          "conversation's rendering, and the reply's content is not found there once, ended as "
          "its turn ends, so where the reply lies in it is not known; train on every token with "
          "--chat-loss all, or give rows of a \"prompt\" and a \"completion\"",
          source, line_no, format.source, what,
          !begins ? "with the generation prompt as" : "through the reply as");
    // A template that does not tell the turns apart (one printing no message at all) renders
    // the turns before this reply as reaching into the last one: where this reply lies is then
    // not known either.
    if (!doc.replies.empty() && before.size() < doc.replies.back().second)
      fail(
          "{} line {}: the chat template {} renders {} with the generation prompt as text that "
          "ends inside the reply before it, so the template does not tell the turns apart; "
          "train on every token with --chat-loss all",
          source, line_no, format.source, what);
    if (through.size() > before.size()) doc.replies.emplace_back(before.size(), through.size());
  };
  if (prompt_messages > 0) {
    reply(prompt_messages, messages.size(), "the prompt's messages");
  } else {
    for (size_t k = 0; k < messages.size(); ++k)
      if (messages[k]["role"] == "assistant")
        reply(k, k + 1, fmt::format("the turns before message {} (an assistant's)", k).c_str());
  }
  if (doc.replies.empty())
    fail(
        "{} line {}: the conversation has {}, so with only the replies counted it would train on "
        "nothing; give it one, or train on every token with --chat-loss all",
        source, line_no,
        prompt_messages > 0 ? "an empty completion" : "no assistant message with text");
  return doc;
}

void each_jsonl(std::string_view text, std::string_view source, const DocumentFn& fn,
                const ConsumedFn& consumed, const ChatOptions* chat) {
  size_t start = 0;
  for (int64_t line_no = 1; start < text.size(); ++line_no) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = strip_eol(text.substr(start, end - start));
    start = end + 1;
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    ojson j;
    try {
      j = ojson::parse(line);
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
    if (string_at("text") && !j.contains("prompt") && !j.contains("completion") &&
        !j.contains("messages")) {
      doc.text = j["text"].get<std::string>();
    } else if (string_at("prompt") && string_at("completion") && !j.contains("text")) {
      doc.prompt = j["prompt"].get<std::string>();
      doc.text = j["completion"].get<std::string>();
    } else if (j.is_object() && (j.contains("messages") || j.contains("conversations") ||
                                 (j.contains("prompt") && j["prompt"].is_array() &&
                                  j.contains("completion") && j["completion"].is_array()))) {
      // A conversation: TRL's "messages" rows, its conversational prompt-completion rows, or
      // ShareGPT's "conversations" (turns of "from" and "value"), read as messages.
      if (j.contains("conversations")) {
        if (j.contains("messages"))
          fail("{} line {}: a row with both \"conversations\" and \"messages\"; give one of them",
               source, line_no);
        j["messages"] = sharegpt_messages(j["conversations"], source, line_no);
        j.erase("conversations");
      }
      if (chat != nullptr && !chat->format.has_value() && !chat->unavailable.empty())
        fail(
            "{} line {}: a conversation needs the model's chat template, which could not be "
            "read: {}",
            source, line_no, chat->unavailable);
      if (chat == nullptr || !chat->format.has_value())
        fail(
            "{} line {}: a conversation needs the model's chat template, and the tokenizer has "
            "none; pass --tokenizer with a model directory whose tokenizer_config.json has a "
            "\"chat_template\" (or that holds chat_template.jinja), or --chat-template FILE",
            source, line_no);
      ojson tools = j.contains("tools") ? j["tools"] : ojson();
      // Datasets stored through Arrow often hold the tools as a JSON string, which TRL parses.
      if (tools.is_string()) {
        tools = ojson::parse(tools.get<std::string>(), nullptr, false);
        if (tools.is_discarded() || !tools.is_array())
          fail("{} line {}: \"tools\" is a string that is not a JSON list of tools; give the list",
               source, line_no);
      }
      Conversation conversation;
      if (j.contains("chat_template_kwargs")) {
        if (!j["chat_template_kwargs"].is_object())
          fail(
              "{} line {}: \"chat_template_kwargs\" is {}; it must be an object of the template's "
              "variables, e.g. {{\"enable_thinking\": false}}",
              source, line_no, j["chat_template_kwargs"].dump().substr(0, 80));
        conversation.template_kwargs = std::move(j["chat_template_kwargs"]);
      }
      if (j.contains("messages")) {
        if (j.contains("prompt") || j.contains("completion") || j.contains("text"))
          fail(
              "{} line {}: a \"messages\" row with a \"prompt\", \"completion\" or "
              "\"text\" too; give one of them",
              source, line_no);
        check_messages(j["messages"], "\"messages\"", source, line_no);
        conversation.messages = std::move(j["messages"]);
      } else {
        check_messages(j["prompt"], "\"prompt\"", source, line_no);
        check_messages(j["completion"], "\"completion\"", source, line_no);
        conversation.prompt_messages = j["prompt"].size();
        conversation.messages = std::move(j["prompt"]);
        for (ojson& m : j["completion"]) conversation.messages.push_back(std::move(m));
      }
      conversation.tools = tools;
      conversation.source = std::string(source);
      conversation.line = line_no;
      conversation.bytes = line.size();
      if (chat->defer) {
        doc.pending = std::make_shared<const Conversation>(std::move(conversation));
      } else {
        doc = render_conversation(*chat, conversation);
      }
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
    if (!doc.text.empty() || !doc.prompt.empty() || doc.pending) fn(std::move(doc));
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

namespace {

std::string read_text_file(const std::filesystem::path& path, std::string_view what) {
  const MappedFile file = MappedFile::open(path, what);
  return std::string(reinterpret_cast<const char*>(file.data()), file.size());
}

}  // namespace

const ChatTemplate& ChatFormat::for_tools(const nlohmann::ordered_json& tools) const {
  const bool with_tools = !tools.is_null() && !(tools.is_array() && tools.empty());
  return with_tools && tool_template ? *tool_template : *default_template;
}

std::string ChatFormat::render(const nlohmann::ordered_json& messages,
                               const nlohmann::ordered_json& tools, bool add_generation_prompt,
                               std::vector<std::pair<uint64_t, uint64_t>>* generation,
                               const nlohmann::ordered_json& kwargs) const {
  // transformers' context: the special tokens, the caller's keyword arguments over them, then
  // the call's own arguments.
  nlohmann::ordered_json context = tokens;
  for (const auto& [key, value] : kwargs.items()) context[key] = value;
  context["messages"] = messages;
  if (!tools.is_null()) context["tools"] = tools;
  context["add_generation_prompt"] = add_generation_prompt;
  return for_tools(tools).render(context, generation);
}

namespace {

// A tokenizer_config.json's "chat_template": one template, or a list of named ones.
void read_config_templates(const nlohmann::json& config, const std::filesystem::path& path,
                           ChatFormat& format) {
  const nlohmann::json& t = config["chat_template"];
  if (t.is_string()) {
    format.default_template = std::make_shared<ChatTemplate>(t.get<std::string>(), path.string());
    return;
  }
  if (t.is_array()) {
    for (const nlohmann::json& named : t) {
      if (!named.is_object() || !named.contains("name") || !named.contains("template") ||
          !named["name"].is_string() || !named["template"].is_string())
        fail(
            "{}: \"chat_template\" lists {}, not a {{\"name\", \"template\"}} object; fix "
            "the file",
            path.string(), named.dump().substr(0, 80));
      const std::string name = named["name"].get<std::string>();
      auto tmpl = std::make_shared<ChatTemplate>(named["template"].get<std::string>(),
                                                 path.string() + " (" + name + ")");
      if (name == "default") format.default_template = tmpl;
      if (name == "tool_use") format.tool_template = tmpl;
    }
    if (!format.default_template)
      fail("{}: \"chat_template\" has no template named \"default\"; name one so", path.string());
    return;
  }
  fail("{}: \"chat_template\" is {}, not a template; fix the file", path.string(), t.type_name());
}

}  // namespace

std::optional<ChatFormat> open_chat_format(const Tokenizer& tokenizer,
                                           std::string_view tokenizer_spec,
                                           const std::string& template_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // The tokenizer's directory, where its tokenizer_config.json and chat_template.jinja lie.
  std::optional<fs::path> dir;
  if (tokenizer_spec != "byte" && !tokenizer_spec.empty()) {
    const fs::path spec(tokenizer_spec);
    dir = fs::is_directory(spec, ec) ? spec : spec.parent_path();
  }
  ChatFormat format;
  const auto read_dir = [&](const fs::path& d) -> bool {
    if (fs::is_regular_file(d / "chat_template.jinja", ec)) {
      const fs::path jinja = d / "chat_template.jinja";
      format.default_template =
          std::make_shared<ChatTemplate>(read_text_file(jinja, "chat template"), jinja.string());
      format.source = jinja.string();
      return true;
    }
    const fs::path config_path = d / "tokenizer_config.json";
    if (!fs::is_regular_file(config_path, ec)) return false;
    const nlohmann::json config = read_json_file(config_path, "tokenizer config");
    if (!config.is_object() || !config.contains("chat_template")) return false;
    read_config_templates(config, config_path, format);
    format.source = config_path.string();
    return true;
  };
  if (!template_path.empty()) {
    const fs::path p(template_path);
    if (fs::is_directory(p, ec)) {
      if (!read_dir(p))
        fail(
            "--chat-template {}: the directory has neither chat_template.jinja nor a "
            "tokenizer_config.json with a \"chat_template\"; pass the template file itself",
            template_path);
    } else if (p.extension() == ".json") {
      const nlohmann::json config = read_json_file(p, "tokenizer config");
      if (!config.is_object() || !config.contains("chat_template"))
        fail(
            "--chat-template {}: the file has no \"chat_template\"; pass a tokenizer_config.json "
            "that has one, or a .jinja template",
            template_path);
      read_config_templates(config, p, format);
      format.source = p.string();
    } else {
      format.default_template =
          std::make_shared<ChatTemplate>(read_text_file(p, "chat template"), p.string());
      format.source = p.string();
    }
  } else if (!dir || !read_dir(*dir)) {
    return std::nullopt;
  }
  // The special tokens transformers hands the template: the tokenizer's own, else (a template
  // given with its tokenizer_config.json) the template's.
  std::optional<fs::path> config_path;
  if (dir && fs::is_regular_file(*dir / "tokenizer_config.json", ec))
    config_path = *dir / "tokenizer_config.json";
  else if (!template_path.empty() && fs::path(template_path).extension() == ".json")
    config_path = fs::path(template_path);
  if (config_path) {
    const nlohmann::json config = read_json_file(*config_path, "tokenizer config");
    for (const char* key : kSpecialTokenKeys) {
      const std::optional<std::string> content = tokenizer_config_token(config, key);
      if (!content) continue;
      format.tokens[key] = *content;
      // A token the tokenizer splits would train the model on its letters, where the template
      // prints it (a config's pad_token that the vocabulary lacks matters to no template).
      const bool printed = format.default_template->mentions(key) ||
                           (format.tool_template && format.tool_template->mentions(key));
      if (!printed) continue;
      const size_t n = tokenizer.encode(*content).size();
      if (n != 1)
        fail(
            "chat template {}: the tokenizer {} reads its {} {} as {} tokens, not as the one "
            "special token it stands for; use the model's tokenizer.json",
            format.source, tokenizer.name(), key, nlohmann::json(*content).dump(), n);
    }
  }
  return format;
}

DocumentFormat document_format_of(const std::filesystem::path& path) {
  return path.extension() == ".jsonl" ? DocumentFormat::jsonl : DocumentFormat::text;
}

void for_each_document(std::string_view text, DocumentFormat format, std::string_view source,
                       const DocumentFn& fn, const ConsumedFn& consumed, const ChatOptions* chat) {
  if (format == DocumentFormat::jsonl)
    each_jsonl(text, source, fn, consumed, chat);
  else
    each_text(text, fn, consumed);
}

std::vector<Document> split_documents(std::string_view text, DocumentFormat format,
                                      std::string_view source, const ChatOptions* chat) {
  std::vector<Document> docs;
  for_each_document(
      text, format, source, [&](Document d) { docs.push_back(std::move(d)); }, {}, chat);
  return docs;
}

void read_documents(const std::filesystem::path& path, const DocumentFn& fn,
                    const ChatOptions* chat) {
  const MappedFile file = MappedFile::open(path, "input text");
  const std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
  file.advise_sequential(0, file.size());
  // The pages read are handed back every 64 MiB, so a large input does not stay resident.
  constexpr uint64_t kRelease = 64ull << 20;
  uint64_t released = 0;
  for_each_document(
      text, document_format_of(path), file.path(), fn,
      [&](uint64_t at) {
        const uint64_t upto = at / kRelease * kRelease;
        if (upto > released) {
          file.release(released, upto - released);
          released = upto;
        }
      },
      chat);
}

std::vector<Document> read_documents(const std::filesystem::path& path) {
  std::vector<Document> docs;
  read_documents(path, [&](Document d) { docs.push_back(std::move(d)); });
  return docs;
}

void render_conversations(std::vector<Document>& documents, const ChatOptions& chat) {
  // Each failure is kept, and the first in order reported: the same error however the work
  // was spread.
  std::vector<std::string> errors(documents.size());
  tbb::parallel_for(tbb::blocked_range<size_t>(0, documents.size()), [&](const auto& range) {
    for (size_t d = range.begin(); d < range.end(); ++d) {
      if (!documents[d].pending) continue;
      try {
        documents[d] = render_conversation(chat, *documents[d].pending);
      } catch (const Error& e) {
        errors[d] = e.what();
      }
    }
  });
  for (const std::string& e : errors)
    if (!e.empty()) throw Error(e);
}

std::vector<uint32_t> tokenize_documents(const Tokenizer& tokenizer,
                                         const std::vector<std::string>& documents, bool append_eos,
                                         bool after_others) {
  std::vector<Document> docs(documents.size());
  for (size_t d = 0; d < documents.size(); ++d) docs[d].text = documents[d];
  return encode_documents(tokenizer, docs, append_eos, after_others).tokens;
}

namespace {

size_t common_prefix(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return k;
}

// A rendered conversation's ids, and its flags (see encode_documents).
void encode_rendered(const Tokenizer& tokenizer, const Document& doc, std::vector<uint32_t>& ids,
                     std::vector<uint8_t>& counts) {
  ids = tokenizer.encode(doc.text);
  counts.assign(ids.size(), doc.replies.empty() ? 1 : 0);
  if (doc.replies.empty()) return;
  const std::string_view text = doc.text;
  // Most templates end and begin each reply at a special token, where the pieces encode apart
  // as they do together: then each piece's flag is its own.
  std::vector<uint32_t> joined;
  std::vector<uint8_t> flags;
  const auto piece = [&](uint64_t from, uint64_t to, uint8_t flag) {
    if (to <= from) return;
    const std::vector<uint32_t> p = tokenizer.encode(text.substr(from, to - from));
    joined.insert(joined.end(), p.begin(), p.end());
    flags.insert(flags.end(), p.size(), flag);
  };
  uint64_t at = 0;
  for (const auto& [a, b] : doc.replies) {
    piece(at, a, 0);
    piece(a, b, 1);
    at = b;
  }
  piece(at, text.size(), 0);
  if (joined == ids) {
    counts = std::move(flags);
    return;
  }
  // Elsewhere a token spans a reply's edge: it counts where it holds a reply's first byte and
  // not where it holds its last.
  for (const auto& [a, b] : doc.replies) {
    const size_t from = common_prefix(tokenizer.encode(text.substr(0, a)), ids);
    const size_t to = common_prefix(tokenizer.encode(text.substr(0, b)), ids);
    for (size_t k = from; k < to; ++k) counts[k] = 1;
  }
}

}  // namespace

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
  // per call), then joined in order: the same stream as one at a time. A prompt and its
  // completion are encoded together, as TRL encodes them and as the model reads them when it
  // answers, and as many tokens as the prompt alone encodes to are the prompt's: encoded apart,
  // a SentencePiece tokenizer's prefixed space made the completion's first token a lone space,
  // and byte-level BPE split "Answer: " + "Paris" as " " + "Paris" where the text reads " Paris".
  std::vector<std::vector<uint32_t>> prompts(documents.size()), texts(documents.size());
  std::vector<std::vector<uint8_t>> flags(documents.size());
  std::vector<uint8_t> straddles(documents.size(), 0);
  tbb::parallel_for(tbb::blocked_range<size_t>(0, documents.size()), [&](const auto& range) {
    for (size_t d = range.begin(); d < range.end(); ++d) {
      const Document& doc = documents[d];
      if (doc.rendered) {
        encode_rendered(tokenizer, doc, texts[d], flags[d]);
        continue;
      }
      if (doc.prompt.empty()) {
        texts[d] = tokenizer.encode(doc.text);
        continue;
      }
      const std::vector<uint32_t> prompt = tokenizer.encode(doc.prompt);
      std::vector<uint32_t> whole = tokenizer.encode(doc.prompt + doc.text);
      const size_t k = std::min(prompt.size(), whole.size());
      // A token across the boundary (TRL warns of the mismatch and masks the same count).
      straddles[d] =
          !std::equal(prompt.begin(), prompt.begin() + static_cast<long>(k), whole.begin()) ||
          k < prompt.size();
      prompts[d].assign(whole.begin(), whole.begin() + static_cast<long>(k));
      texts[d].assign(whole.begin() + static_cast<long>(k), whole.end());
    }
  });
  size_t total = 0;
  for (size_t d = 0; d < documents.size(); ++d)
    total += prompts[d].size() + texts[d].size() + prefix.size() + suffix.size() + 1;
  TokenStream out;
  out.tokens.reserve(total + 1);
  out.counts.reserve(total + 1);
  const auto put = [&](const std::vector<uint32_t>& ids, uint8_t counts) {
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.counts.insert(out.counts.end(), ids.size(), counts);
  };
  if (after_others && !documents.empty() && !suffix_ends) put({*eos}, 1);
  for (size_t d = 0; d < documents.size(); ++d) {
    const Document& doc = documents[d];
    // End-of-text ends each document but the last (and that one too with append_eos); a
    // completion's end counts: the model learns to stop.
    const bool separated = d + 1 < documents.size() || append_eos;
    const size_t start = out.tokens.size();
    out.starts.push_back(start);
    if (doc.rendered) {
      put(texts[d], 1);
      std::copy(flags[d].begin(), flags[d].end(),
                out.counts.end() - static_cast<long>(flags[d].size()));
      // The template writes each turn's end: no end-of-text follows, as TRL adds none to a
      // conversation.
      out.prompted = out.prompted || !doc.replies.empty();
    } else {
      const bool prompted = !doc.prompt.empty();
      out.prompted = out.prompted || prompted;
      out.straddling += straddles[d];
      put(prefix, prompted ? 0 : 1);
      put(prompts[d], 0);
      put(texts[d], 1);
      put(suffix, 1);
      // Not after text that already ends with it, as TRL's add_eos checks.
      const std::vector<uint32_t>& last = !suffix.empty()     ? suffix
                                          : !texts[d].empty() ? texts[d]
                                                              : prompts[d];
      if (separated && !suffix_ends && (last.empty() || last.back() != *eos)) put({*eos}, 1);
    }
    if (out.tokens.size() == start) out.starts.pop_back();  // no tokens: no document
    std::vector<uint32_t>().swap(prompts[d]);
    std::vector<uint32_t>().swap(texts[d]);
    std::vector<uint8_t>().swap(flags[d]);
  }
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
  DocumentIndexWriter indexes(output, shard_tokens);
  // Documents are held a batch at a time: read in order, encoded in parallel, written in order.
  // A full batch is written when the next document arrives, so the last batch is known to be
  // the last (--append-eos).
  std::vector<Document> batch;
  uint64_t held = 0;
  // Conversations are rendered a batch at a time on every core, not as they are read.
  std::optional<ChatOptions> chat;
  if (options.chat != nullptr) {
    chat = *options.chat;
    chat->defer = true;
  }
  auto flush = [&](bool last) {
    if (chat) render_conversations(batch, *chat);
    for (const Document& doc : batch) {
      r.prompted += doc.prompt.empty() && doc.replies.empty() ? 0 : 1;
      r.conversations += doc.rendered ? 1 : 0;
      r.bytes += doc.prompt.size() + doc.text.size();
    }
    // End-of-text after the batch's last document, where more follow (or --append-eos).
    const TokenStream stream = encode_documents(tokenizer, batch, !last || append_eos);
    if (stream.prompted && !masks) {
      masks = std::make_unique<LossMaskWriter>(output, shard_tokens);
      masks->write_ones(writer.tokens());
    }
    const uint64_t base = writer.tokens();
    writer.write(stream.tokens);  // before its flags: a mask shard closes on complete tokens
    for (uint64_t start : stream.starts) indexes.add(base + start);
    if (masks) masks->write(stream.counts);
    for (uint8_t c : stream.counts) r.counted += c;
    r.straddling += stream.straddling;
    batch.clear();
    held = 0;
  };
  for (const std::filesystem::path& input : inputs) {
    uint64_t in_file = 0;
    read_documents(
        input,
        [&](Document doc) {
          ++in_file;
          if (!response.empty() && doc.prompt.empty() && !doc.pending) {
            const size_t at = doc.text.find(response);
            if (at == std::string::npos) {
              ++r.untemplated;
              return;
            }
            doc.prompt = doc.text.substr(0, at + response.size());
            doc.text.erase(0, at + response.size());
          }
          if (held >= batch_bytes) flush(false);
          // A conversation's rendering is about its row's size.
          const uint64_t bytes =
              doc.pending ? doc.pending->bytes : doc.prompt.size() + doc.text.size();
          if (memory > 0 && bytes > memory / kDocumentBytesPerByte)
            fail(
                "tokenize: document {} of {} is {}; a document is encoded whole, about {} bytes of "
                "memory a byte ({}), more than the {} available; cut it into documents: lines "
                "holding only % separate the documents of a .txt, and a .jsonl holds one per line",
                in_file, input.string(), format_bytes(bytes), kDocumentBytesPerByte,
                format_bytes(bytes * kDocumentBytesPerByte), format_bytes(memory));
          held += bytes;
          ++r.documents;
          batch.push_back(std::move(doc));
        },
        chat ? &*chat : nullptr);
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
  r.indexes = indexes.finish(r.files);
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

// fuzz_chat_template.cpp: the chat template reader and interpreter on arbitrary bytes.
//
// The input is a template's text, as a model directory's chat_template.jinja holds it. When it
// parses, it is rendered with a conversation (system, user, an assistant tool call, the tool's
// result, an assistant reply) and tools, with and without the generation prompt, as
// `strata tokenize` renders a "messages" row. Then that row and a two-exchange conversation go
// through `strata tokenize`'s reading of conversations, which finds each reply (the turns-before
// rule, else by its content): the replies found must lie in order inside the rendering. A
// strata::Error is the template being refused or raising; anything else (a crash, a hang, a
// runaway allocation, replies out of order or outside the text) is a finding.
#include "core/error.h"
#include "train/chat_template.h"
#include "train/tokenizer.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace {

// The rows' replies lie inside their renderings, in order and apart.
void check_replies(const std::shared_ptr<const strata::ChatTemplate>& t) {
  strata::ChatOptions chat;
  chat.format = strata::ChatFormat{
      t, nullptr, nlohmann::ordered_json{{"bos_token", "<s>"}, {"eos_token", "</s>"}},
      "fuzz.jinja"};
  static const char* const kRows =
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief. \"}, {\"role\": "
      "\"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello!\"}, "
      "{\"role\": \"user\", \"content\": \"2+2?\"}, {\"role\": \"assistant\", \"content\": "
      "\"4\"}]}\n"
      "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
      "\"Weather?\"}]}, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": "
      "[{\"type\": \"function\", \"function\": {\"name\": \"w\", \"arguments\": {}}}]}, "
      "{\"role\": \"tool\", \"content\": \"21\"}, {\"role\": \"assistant\", \"content\": "
      "\"QuiZ\"}]}\n";
  std::string_view rows = kRows;
  while (!rows.empty()) {
    const size_t end = rows.find('\n') + 1;
    try {
      for (const strata::Document& d : strata::split_documents(
               rows.substr(0, end), strata::DocumentFormat::jsonl, "fuzz.jsonl", &chat)) {
        uint64_t at = 0;
        for (const auto& [b, e] : d.replies) {
          if (b < at || e < b || e > d.text.size()) __builtin_trap();
          at = e;
        }
      }
    } catch (const strata::Error&) {
    }
    rows.remove_prefix(end);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "bos_token": "<s>", "eos_token": "</s>",
    "messages": [
      {"role": "system", "content": "Be brief. "},
      {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
      {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function":
        {"name": "weather", "arguments": {"city": "Paris", "days": 2}}}]},
      {"role": "tool", "content": "{\"temp\": 21.5}"},
      {"role": "assistant", "content": " It is 21.5 \u00b0C. \ud83c\udf24"}
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters":
      {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
  })");
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto t = std::make_shared<const strata::ChatTemplate>(text, "fuzz.jinja");
    for (const bool prompt : {false, true}) {
      nlohmann::ordered_json c = context;
      c["add_generation_prompt"] = prompt;
      try {
        (void)t->render(c);
      } catch (const strata::Error&) {
      }
    }
    check_replies(t);
  } catch (const strata::Error&) {
    return 0;  // refused: expected for most inputs
  }
  return 0;
}

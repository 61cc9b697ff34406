// chat_template.h: a model's chat template, the Jinja program in its tokenizer_config.json
// ("chat_template") or chat_template.jinja, run as Hugging Face's apply_chat_template runs it,
// so `strata tokenize` can render conversations ("messages" rows) into the text the model was
// tuned on.
//
// The template language is the part of Jinja that chat templates use, with the environment
// transformers gives them: blocks trimmed (trim_blocks, lstrip_blocks), `{%- -%}` whitespace
// control, comments; statements if/elif/else, for (with `loop`, an else branch, unpacking, a
// filter condition, break and continue), set (names, namespace attributes, blocks), macro and
// call, generation (TRL's assistant markers: rendered as their body), filter blocks; expressions
// with Python's literals, operators (arithmetic, `~`, comparisons, `in`, `and`/`or`/`not`,
// `a if c else b`), attributes, subscripts, slices, calls, filters and tests; the string, list
// and dict methods templates call (strip, split, startswith, items, get, ...); the globals
// raise_exception, namespace, range, strftime_now. Values print as Python prints them. A name
// that is not defined is Jinja's default Undefined: false, empty, printed as nothing, an error
// only when used as a value. Strings marked safe (|safe, |e) behave as Jinja's Markup: beside
// one, + HTML-escapes the other string. Anything else is an Error naming the template, its line
// and what is not supported; nothing is silently rendered differently. So is a template that
// runs away (recursion or nesting past 200, text past 256 MiB, lists past 2^20 items, more than
// 2^20 loop passes): a model directory is downloaded input.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata {

class ChatTemplate {
 public:
  // Parses `source`; `name` (the file it came from) is named in every error, with the line.
  ChatTemplate(std::string_view source, std::string name);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // The template rendered with `context`'s keys as its variables (messages,
  // add_generation_prompt, bos_token, eos_token, tools, ...), JSON objects keeping their key
  // order as Python's dicts do. raise_exception(message) in the template is an Error holding
  // the message; strftime_now(format) formats the local time now.
  // `generation`, when given, gets the byte ranges of the result that {% generation %} blocks
  // wrote (TRL's markers of the assistant's text, as transformers' return_assistant_tokens_mask
  // finds them; a block inside a macro or a captured {% set %} marks nothing).
  std::string render(const nlohmann::ordered_json& context,
                     std::vector<std::pair<uint64_t, uint64_t>>* generation = nullptr) const;
  // Whether the template has {% generation %} blocks.
  bool has_generation() const;
  // Whether its text holds `word` anywhere (a variable it may print, say).
  bool mentions(std::string_view word) const;

  const std::string& name() const { return name_; }

 private:
  struct Program;
  std::unique_ptr<Program> program_;
  std::string name_;
};

}  // namespace strata

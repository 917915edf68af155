"""`ember router`: the fleet's front door. An OpenAI-compatible proxy that sends each request to the engine
pod holding the longest cached prefix of its prompt, within a bounded load, and sheds or retries for the
fleet as a whole.
"""

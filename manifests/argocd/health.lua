-- Argo CD health for ember.dev/InferenceService.
-- Argo CD itself reports "Pending deletion" before calling this, and runs it on Lua 5.1 with only the base
-- and table libraries: no string.*, no math.*, no methods on strings.
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

-- "Reason: message", or whichever of the two is set.
local function describe(c, fallback)
  local reason = c.reason
  local message = c.message
  if reason == "" then
    reason = nil
  end
  if message == "" then
    message = nil
  end
  if reason ~= nil and message ~= nil then
    return reason .. ": " .. message
  end
  return message or reason or fallback
end

local function count(value)
  if value == nil then
    return 0
  end
  return value
end

local generation = obj.metadata.generation
local status = obj.status

-- A status that predates the latest spec describes the old spec, whatever its conditions say.
if status == nil or status.observedGeneration == nil
    or (generation ~= nil and status.observedGeneration < generation) then
  hs.status = "Progressing"
  if generation ~= nil then
    hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  else
    hs.message = "Waiting for the operator"
  end
  return hs
end

-- Stalled and Reconciling are abnormal-true (kstatus): their absence means all is well.
local stalled = condition(status, "Stalled")
if is_true(stalled) then
  hs.status = "Degraded"
  hs.message = describe(stalled, "Stalled")
  return hs
end

local reconciling = condition(status, "Reconciling")
if is_true(reconciling) then
  hs.status = "Progressing"
  hs.message = describe(reconciling, "Reconciling")
  return hs
end

-- Zero active replicas on purpose (replicas.min 0, or an external autoscaler at 0) is not a failure.
if status.replicas == 0 and status.desiredReplicas == 0 then
  hs.status = "Suspended"
  hs.message = "Scaled to zero, " .. tostring(count(status.warmReplicas)) .. " warm"
  return hs
end

local ready = condition(status, "Ready")
if is_true(ready) then
  hs.status = "Healthy"
  hs.message = tostring(count(status.replicas)) .. " active, " .. tostring(count(status.warmReplicas))
      .. " warm, " .. tostring(count(status.readyReplicas)) .. " ready"
  return hs
end

if ready ~= nil and ready.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(ready, "Not ready")
  return hs
end

-- Ready missing or Unknown: the operator has not decided yet.
hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready, "Waiting for the Ready condition")
else
  hs.message = "Waiting for the Ready condition"
end
return hs
